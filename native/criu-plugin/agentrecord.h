/* The agent's device record of a stopped process (agentrecord.c). */
#ifndef NPUSNAP_PLUGIN_AGENTRECORD_H
#define NPUSNAP_PLUGIN_AGENTRECORD_H

/* 1 when pid (nspid in its own pid namespace) holds no device state by every sign a node offers:
 * its agent's record counts no device-opening call of its own, and /proc shows no device mapping
 * and no device file; 0 otherwise, and when anything cannot be read. */
int npusnap_never_opened_a_device(int pid, int nspid);

#endif
