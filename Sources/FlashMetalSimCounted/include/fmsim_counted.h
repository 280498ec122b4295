/* fmsim_counted.h — the counted copies of the shaders have no interface of
 * their own: each registers itself with the simulator when the library loads,
 * and fmsim_dispatch runs it for a dispatch that asks for counts (fmsim.h). */
#ifndef FMSIM_COUNTED_H
#define FMSIM_COUNTED_H
#endif
