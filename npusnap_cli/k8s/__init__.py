"""Kubernetes: checkpoints through a node's container runtime (CRI) or its kubelet, one container
or a whole job of pods (docs/runbooks/kubernetes.md)."""
