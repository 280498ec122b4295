// context_switch.cpp — fm_ctx_switch(void **save_sp, void *next_sp):
// saves the callee-saved registers on the current stack, stores the stack
// pointer in *save_sp, loads next_sp and restores the registers saved there.
// fm_ctx_init prepares a fresh stack whose first switch "returns" into entry.
// The symbol is hidden: it is not part of libflashmetal's C ABI.
#if defined(__APPLE__) && defined(FMSIM_USE_UCONTEXT) && !defined(_XOPEN_SOURCE)
// macOS declares the (deprecated) ucontext routines only under _XOPEN_SOURCE,
// which in turn hides the BSD extensions unless _DARWIN_C_SOURCE is set too.
#define _XOPEN_SOURCE 700
#define _DARWIN_C_SOURCE
#endif
#include <stdint.h>
#include <stddef.h>
#include "simulator_internal.h"

#if defined(__APPLE__)
#define FM_SYM(x) "_" #x
#define FM_HIDDEN(x) ".private_extern _" #x "\n"
#else
#define FM_SYM(x) #x
#define FM_HIDDEN(x) ".hidden " #x "\n"
#endif

#if defined(__x86_64__) && !defined(FMSIM_USE_UCONTEXT)
asm(".text\n"
    ".globl " FM_SYM(fm_ctx_switch) "\n"
    FM_HIDDEN(fm_ctx_switch)
#if !defined(__APPLE__)
    ".type fm_ctx_switch,@function\n"
#endif
    ".p2align 4\n"
    FM_SYM(fm_ctx_switch) ":\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  subq $8, %rsp\n"
    "  stmxcsr (%rsp)\n"
    "  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n"
    "  fldcw 4(%rsp)\n"
    "  addq $8, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
#if !defined(__APPLE__)
    ".size fm_ctx_switch, .-fm_ctx_switch\n"
    ".section .note.GNU-stack,\"\",@progbits\n"
    ".text\n"
#endif
);
extern "C" __attribute__((visibility("hidden"))) void fm_ctx_switch(void **save_sp, void *next_sp);

namespace fmsim {
void *ctx_init(char *stack, size_t size, void (*entry)()) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
    uint64_t *sp = reinterpret_cast<uint64_t *>(top);
    *--sp = 0;                                   // fake return address of entry
    *--sp = reinterpret_cast<uint64_t>(entry);   // ret target
    for (int i = 0; i < 6; i++) *--sp = 0;       // rbp rbx r12-r15
    uint32_t csr[2];
    asm volatile("stmxcsr %0" : "=m"(csr[0]));
    asm volatile("fnstcw %0" : "=m"(*(uint16_t *)&csr[1]));
    *--sp = (uint64_t)csr[0] | ((uint64_t)csr[1] << 32);
    return sp;
}
void ctx_switch(void **save, void *next) { fm_ctx_switch(save, next); }
const char *ctx_kind() { return "x86-64 asm"; }
} // namespace fmsim

#elif defined(__aarch64__) && !defined(FMSIM_USE_UCONTEXT)
asm(".text\n"
    ".globl " FM_SYM(fm_ctx_switch) "\n"
    FM_HIDDEN(fm_ctx_switch)
    ".p2align 4\n"
    FM_SYM(fm_ctx_switch) ":\n"
    "  sub sp, sp, #176\n"
    "  stp x19, x20, [sp, #0]\n"
    "  stp x21, x22, [sp, #16]\n"
    "  stp x23, x24, [sp, #32]\n"
    "  stp x25, x26, [sp, #48]\n"
    "  stp x27, x28, [sp, #64]\n"
    "  stp x29, x30, [sp, #80]\n"
    "  stp d8, d9, [sp, #96]\n"
    "  stp d10, d11, [sp, #112]\n"
    "  stp d12, d13, [sp, #128]\n"
    "  stp d14, d15, [sp, #144]\n"
    "  mov x2, sp\n"
    "  str x2, [x0]\n"
    "  mov sp, x1\n"
    "  ldp x19, x20, [sp, #0]\n"
    "  ldp x21, x22, [sp, #16]\n"
    "  ldp x23, x24, [sp, #32]\n"
    "  ldp x25, x26, [sp, #48]\n"
    "  ldp x27, x28, [sp, #64]\n"
    "  ldp x29, x30, [sp, #80]\n"
    "  ldp d8, d9, [sp, #96]\n"
    "  ldp d10, d11, [sp, #112]\n"
    "  ldp d12, d13, [sp, #128]\n"
    "  ldp d14, d15, [sp, #144]\n"
    "  add sp, sp, #176\n"
    "  ret\n");
extern "C" __attribute__((visibility("hidden"))) void fm_ctx_switch(void **save_sp, void *next_sp);

namespace fmsim {
void *ctx_init(char *stack, size_t size, void (*entry)()) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
    uint64_t *sp = reinterpret_cast<uint64_t *>(top - 176);
    for (int i = 0; i < 22; i++) sp[i] = 0;
    sp[11] = reinterpret_cast<uint64_t>(entry);  // x30 slot (offset 88)
    return sp;
}
void ctx_switch(void **save, void *next) { fm_ctx_switch(save, next); }
const char *ctx_kind() { return "arm64 asm"; }
} // namespace fmsim

#else
// Portable fallback: swapcontext (slower: it makes a sigprocmask syscall).
#include <ucontext.h>
namespace fmsim {
struct UCtx { ucontext_t uc; };
void *ctx_init(char *stack, size_t size, void (*entry)()) {
    // The ucontext lives at the top of the stack area.
    uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size - sizeof(UCtx)) & ~uintptr_t(63);
    UCtx *c = reinterpret_cast<UCtx *>(top);
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = top - reinterpret_cast<uintptr_t>(stack);
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, entry, 0);
    return c;
}
void ctx_switch(void **save, void *next) {
    UCtx self;
    *save = &self;
    swapcontext(&self.uc, &static_cast<UCtx *>(next)->uc);
}
const char *ctx_kind() { return "swapcontext"; }
} // namespace fmsim
#endif

// ---- micro-benchmark: one context switch, measured as a ping-pong ----------
#include <chrono>
namespace {
void *g_main_sp, *g_fib_sp;
long g_iters;
void bench_entry() {
    for (;;) fmsim::ctx_switch(&g_fib_sp, g_main_sp);
}
} // namespace
extern "C" double fmsim_bench_switch_ns(long iters) {
    static char stack[64 * 1024] __attribute__((aligned(64)));
    g_iters = iters;
    g_fib_sp = fmsim::ctx_init(stack, sizeof stack, bench_entry);
    auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < iters; i++) fmsim::ctx_switch(&g_main_sp, g_fib_sp);
    auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / double(2 * iters);
}
