// simulator_internal.h — fiber context primitives (context_switch.cpp).
#pragma once
#include <stddef.h>
namespace fmsim {
// Prepares a stack so that the first ctx_switch into the returned pointer
// starts `entry` (which must never return).
void *ctx_init(char *stack, size_t size, void (*entry)());
// Saves the current context in *save and resumes `next`.
void ctx_switch(void **save, void *next);
const char *ctx_kind();
} // namespace fmsim
