/* Wire format between the simulated runtime (C) and the device daemon (npusnap_sim/daemon.py):
 * the ops, flags and structs are generated from native/contract/npusnap.toml (its [npusim] part),
 * which also generates npusnap_cli/contract.py for the daemon's side. */
#ifndef NPUSIM_WIRE_H
#define NPUSIM_WIRE_H
#include "npusnap/contract.h"
#endif
