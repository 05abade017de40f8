/* What a plugin uses of the CRIU that loads it: criu-plugin.h (its hooks' table; its prototypes
 * name parameters they do not use) and the functions the criu binary exports to plugins. Shared
 * by npusnap_plugin.so and the simulated NPU's npusim_plugin.so. */
#ifndef NPUSNAP_CRIU_HOST_H
#define NPUSNAP_CRIU_HOST_H

#include <stdbool.h>
#include <stddef.h>

#pragma GCC visibility push(default)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <criu-plugin.h>
#pragma GCC diagnostic pop
#pragma GCC visibility pop

/* Exported by the criu binary (criu/include/image.h, seize.h, log.h). */
extern int add_inventory_plugin(const char *name);
extern bool check_and_remove_inventory_plugin(const char *name, size_t n);
extern void set_compel_interrupt_only_mode(void);
extern bool alarm_timeouted(void); /* CRIU's freeze timeout (--timeout) ran out */
extern void print_on_level(unsigned int loglevel, const char *format, ...)
    __attribute__((format(printf, 2, 3)));

#endif
