// registry.cpp — kernels registered by host name (INSTANTIATE_KERNEL).
//
// Registration runs in static constructors (while the library loads, one
// thread); afterwards the table only is read, so lookups take no lock and a
// fork() can never inherit it locked. Nothing here throws across the C ABI.
#include "simulator.h"
#include "include/fmsim.h"
#include <cstring>
#include <mutex>
#include <vector>

namespace fmsim {
namespace {
std::mutex &reg_mu() { static std::mutex m; return m; }
std::vector<const KernelEntry *> &reg() { static std::vector<const KernelEntry *> v; return v; }
// The counted copies, apart: listing and plain lookups never see them.
std::vector<const KernelEntry *> &reg_counted() { static std::vector<const KernelEntry *> v; return v; }
} // namespace

void register_kernel(const KernelEntry *e) {
    std::lock_guard<std::mutex> g(reg_mu());
    auto &table = e->counted ? reg_counted() : reg();
    for (auto &x : table)
        if (strcmp(x->name, e->name) == 0) { x = e; return; }
    try {
        table.push_back(e);
    } catch (...) {
        // Out of memory while loading: the kernel stays unknown, and a
        // dispatch of it reports so instead of the load aborting.
    }
}

const KernelEntry *find_kernel(const char *name) {
    for (auto *x : reg())
        if (strcmp(x->name, name) == 0) return x;
    return nullptr;
}

const KernelEntry *find_counted_kernel(const char *name) {
    for (auto *x : reg_counted())
        if (strcmp(x->name, name) == 0) return x;
    return nullptr;
}
} // namespace fmsim

extern "C" int fmsim_has_kernel(const char *name) { return name && fmsim::find_kernel(name) ? 1 : 0; }

extern "C" int fmsim_kernel_count(void) { return int(fmsim::reg().size()); }

extern "C" const char *fmsim_kernel_name(int i) {
    if (i < 0 || size_t(i) >= fmsim::reg().size()) return nullptr;
    return fmsim::reg()[size_t(i)]->name;
}

extern "C" int fmsim_kernel_param(const char *name, int index, int *kind, uint32_t *align) {
    const fmsim::KernelEntry *e = name ? fmsim::find_kernel(name) : nullptr;
    if (!e || index < 0 || index >= e->n_params) return 0;
    if (kind) *kind = e->kinds[index];
    if (align) *align = e->aligns[index];
    return 1;
}

extern "C" int fmsim_has_counted_kernel(const char *name) {
    return name && fmsim::find_counted_kernel(name) ? 1 : 0;
}
