// The emulator's runtime: runs a kernel's grid on the CPU, one block at a time, each of the
// block's threads a fiber (see `cuda_emu.h` and `kernels/README.md`).
//
// A fiber runs until it reaches a sync point (a barrier, a warp collective, its end) and is
// parked there. When no fiber can run, the runtime completes what the parked fibers agree on:
// a warp whose 32 lanes all wait at the same collective (same call site, same ordinal, full
// mask) gets its results; a block whose live threads all wait at the same barrier passes it.
// Anything else (lanes of a warp at different places, a thread at a barrier while another has
// finished, a partial mask) stops the run with a report. The order in which ready fibers are
// resumed is the schedule; a race on shared memory changes the output under some schedule.

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <algorithm>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "cuda_emu.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PENSIEVE_EMU_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define PENSIEVE_EMU_ASAN 1
#endif
#ifdef PENSIEVE_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

extern "C" char __start_pensieve_emu_shared[] __attribute__((weak));
extern "C" char __stop_pensieve_emu_shared[] __attribute__((weak));

namespace pensieve_emu {
namespace {

#ifdef PENSIEVE_EMU_ASAN
constexpr size_t STACK = 1 << 20;  // instrumented frames are several times larger
#else
constexpr size_t STACK = 256 << 10;
#endif

// Switching stacks: a few instructions on x86-64 (callee-saved registers and the FP control
// words, as the ABI requires), ucontext elsewhere.
#if defined(__x86_64__)
extern "C" void pensieve_emu_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl pensieve_emu_switch
.type pensieve_emu_switch,@function
pensieve_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size pensieve_emu_switch, .-pensieve_emu_switch
.section .note.GNU-stack,"",@progbits
.text
)");

struct Context {
    void* sp = nullptr;
};

void start_context(Context& c, char* stack, size_t size, void (*entry)()) {
    uintptr_t top = ((uintptr_t)(stack + size)) & ~(uintptr_t)15;
    auto* words = reinterpret_cast<uint64_t*>(top);
    words[-1] = 0;                        // the entry's return address: it never returns
    words[-2] = (uint64_t)(uintptr_t)entry;  // where the first switch "returns" to
    for (int r = 3; r <= 8; ++r) words[-r] = 0;  // rbp, rbx, r12-r15
    uint32_t mxcsr = 0x1f80;
    uint16_t fpucw = 0x037f;
    char* control = reinterpret_cast<char*>(&words[-9]);
    memcpy(control, &mxcsr, 4);
    memcpy(control + 4, &fpucw, 2);
    c.sp = &words[-9];
}

void swap(Context& from, Context& to) { pensieve_emu_switch(&from.sp, to.sp); }
#else
struct Context {
    ucontext_t uc;
};

void start_context(Context& c, char* stack, size_t size, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}

void swap(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

enum class State { Ready, AtBarrier, AtCollective, Done };

// An asynchronous copy not landed yet: its destination and the bytes read when it was issued.
struct Copy {
    unsigned char* dst;
    std::vector<unsigned char> bytes;
};

struct Fiber {
    Context context;
    char* stack = nullptr;
    unsigned tid = 0;
    State state = State::Ready;
    // Where it is parked, and how many sync points of that kind it passed before.
    const char* file = nullptr;
    int line = 0;
    uint64_t barriers = 0, collectives = 0;
    Collective kind = Collective::SyncWarp;
    unsigned mask = 0;
    uint32_t value = 0, result = 0;
    int arg = 0;
    MatrixOp* op = nullptr;
    // Asynchronous copies issued since the last commit, and the committed groups, oldest first.
    std::vector<Copy> open;
    std::deque<std::vector<Copy>> pending;
};

// The run in progress: one at a time in the process (shared memory is one section).
struct Run {
    dim3 grid{1, 1, 1}, block{1, 1, 1}, block_idx{0, 0, 0};
    void (*body)(void*) = nullptr;
    void* ctx = nullptr;
    std::vector<Fiber> fibers;
    Context scheduler;
    Fiber* current = nullptr;
    std::string error;
    // The dynamic shared memory: `dynamic_bytes` ending where a protected page starts, inside
    // the mapping at `mapping` of `mapped` bytes.
    unsigned char* dynamic = nullptr;
    size_t dynamic_bytes = 0;
    void* mapping = nullptr;
    size_t mapped = 0;
};

std::mutex RUNS;
Run* RUN = nullptr;
#ifdef PENSIEVE_EMU_ASAN
void* FAKE_STACK = nullptr;
#endif

void enter(Fiber& f) {
    RUN->current = &f;
#ifdef PENSIEVE_EMU_ASAN
    __sanitizer_start_switch_fiber(&FAKE_STACK, f.stack, STACK);
#endif
    swap(RUN->scheduler, f.context);
#ifdef PENSIEVE_EMU_ASAN
    __sanitizer_finish_switch_fiber(FAKE_STACK, nullptr, nullptr);
#endif
    RUN->current = nullptr;
}

void park(Fiber& f) {
#ifdef PENSIEVE_EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, nullptr, 0);
#endif
    swap(f.context, RUN->scheduler);
#ifdef PENSIEVE_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

void fiber_main() {
#ifdef PENSIEVE_EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    Fiber& f = *RUN->current;
    RUN->body(RUN->ctx);
    f.state = State::Done;
    park(f);
    abort();  // a finished fiber is never resumed
}

Fiber& self() {
    if (RUN == nullptr || RUN->current == nullptr) {
        fprintf(stderr, "pensieve emulator: a CUDA intrinsic called outside a kernel launch\n");
        abort();
    }
    return *RUN->current;
}

std::string where(const Fiber& f) {
    char buf[256];
    const char* what = f.state == State::AtBarrier ? "__syncthreads" : "a warp collective";
    if (f.state == State::Done)
        snprintf(buf, sizeof buf, "thread %u at its end", f.tid);
    else
        snprintf(buf, sizeof buf, "thread %u at %s (%s:%d, #%llu)", f.tid, what,
                 f.file ? f.file : "?", f.line,
                 (unsigned long long)(f.state == State::AtBarrier ? f.barriers : f.collectives));
    return buf;
}

bool fail(const std::string& what, const Fiber& a, const Fiber& b) {
    char head[128];
    snprintf(head, sizeof head, "block (%u, %u, %u): ", RUN->block_idx.x, RUN->block_idx.y,
             RUN->block_idx.z);
    RUN->error = head + what + ": " + where(a) + "; " + where(b);
    return false;
}

uint32_t lane_result(const std::vector<Fiber*>& lanes, int lane) {
    const Fiber& f = *lanes[lane];
    switch (f.kind) {
        case Collective::SyncWarp:
        case Collective::Matrix:
            return 0;
        case Collective::ShflXor:
            return lanes[(lane ^ f.arg) & 31]->value;
        case Collective::ShflIdx:
            return lanes[f.arg & 31]->value;
        case Collective::ShflDown:
            return lane + f.arg < 32 ? lanes[lane + f.arg]->value : f.value;
        case Collective::ShflUp:
            return lane - f.arg >= 0 ? lanes[lane - f.arg]->value : f.value;
        case Collective::Ballot:
        case Collective::Any:
        case Collective::All: {
            uint32_t bits = 0;
            for (int i = 0; i < 32; ++i) bits |= (lanes[i]->value ? 1u : 0u) << i;
            if (f.kind == Collective::Ballot) return bits;
            if (f.kind == Collective::Any) return bits != 0;
            return bits == 0xffffffffu;
        }
    }
    return 0;
}

// Completes the collectives whole warps wait at; false with RUN->error on a disagreement.
bool settle_warps(bool& progressed) {
    const unsigned n = (unsigned)RUN->fibers.size();
    for (unsigned w = 0; w * 32 < n; ++w) {
        std::vector<Fiber*> lanes;
        for (unsigned t = w * 32; t < std::min(n, w * 32 + 32); ++t) lanes.push_back(&RUN->fibers[t]);
        const Fiber* waiting = nullptr;
        for (Fiber* f : lanes)
            if (f->state == State::AtCollective) waiting = f;
        if (waiting == nullptr) continue;
        if (lanes.size() < 32) return fail("a warp collective in a partial warp", *waiting, *waiting);
        bool pending = false;  // a lane still running may yet get there
        for (Fiber* f : lanes) pending |= f->state == State::Ready;
        if (pending) continue;
        for (Fiber* f : lanes) {
            if (f->state != State::AtCollective)
                return fail("lanes of a warp diverged at a warp collective", *waiting, *f);
            if (f->mask != 0xffffffffu)
                return fail("a warp collective without the full mask", *f, *f);
            if (f->kind != waiting->kind || f->line != waiting->line ||
                f->file != waiting->file || f->collectives != waiting->collectives)
                return fail("lanes of a warp at different collectives", *waiting, *f);
        }
        if (waiting->kind == Collective::Matrix) {
            MatrixOp* ops[32];
            for (int l = 0; l < 32; ++l) ops[l] = lanes[l]->op;
            for (int l = 0; l < 32; ++l)
                if (ops[l]->run != ops[0]->run)
                    return fail("lanes of a warp at different matrix operations", *lanes[0], *lanes[l]);
            if (const char* why = ops[0]->run(ops)) return fail(why, *waiting, *waiting);
        }
        std::vector<uint32_t> results(32);
        for (int l = 0; l < 32; ++l) results[l] = lane_result(lanes, l);
        for (int l = 0; l < 32; ++l) {
            lanes[l]->result = results[l];
            lanes[l]->state = State::Ready;
            lanes[l]->collectives++;
        }
        progressed = true;
    }
    return true;
}

// Passes the barrier every live thread waits at; false with RUN->error on a disagreement.
bool settle_block(bool& all_done) {
    const Fiber* at = nullptr;
    const Fiber* done = nullptr;
    for (const Fiber& f : RUN->fibers) {
        if (f.state == State::AtBarrier) at = &f;
        if (f.state == State::Done) done = &f;
    }
    all_done = at == nullptr;
    if (at == nullptr) return true;
    if (done != nullptr) return fail("a thread finished while others wait at a barrier", *at, *done);
    for (Fiber& f : RUN->fibers) {
        if (f.line != at->line || f.file != at->file || f.barriers != at->barriers)
            return fail("threads of a block at different barriers", *at, f);
    }
    for (Fiber& f : RUN->fibers) {
        f.state = State::Ready;
        f.barriers++;
    }
    return true;
}

// The resume order of one round: 0 lockstep (thread order), 1 reverse, 2 the last warp
// first and as far as it gets, 3 a fresh random order each round.
std::vector<unsigned> order(int schedule, std::mt19937_64& rng) {
    const unsigned n = (unsigned)RUN->fibers.size();
    std::vector<unsigned> ids(n);
    for (unsigned i = 0; i < n; ++i) ids[i] = i;
    if (schedule == 1) std::reverse(ids.begin(), ids.end());
    if (schedule == 2) {
        const unsigned last = (n - 1) / 32 * 32;
        std::vector<unsigned> ahead;
        for (unsigned i = last; i < n; ++i)
            if (RUN->fibers[i].state == State::Ready) ahead.push_back(i);
        if (!ahead.empty()) return ahead;
    }
    if (schedule == 3) std::shuffle(ids.begin(), ids.end(), rng);
    return ids;
}

// All bits set in every byte of shared memory. Under AddressSanitizer the section holds the
// redzones between the arrays too, which a checked memset would report: those bytes are
// written unchecked (their shadow, not their contents, is what ASan reads).
#ifdef PENSIEVE_EMU_ASAN
__attribute__((no_sanitize_address)) void poison_shared() {
    for (volatile char* p = __start_pensieve_emu_shared; p < __stop_pensieve_emu_shared; ++p)
        *p = (char)0xff;
}
#else
void poison_shared() {
    memset(__start_pensieve_emu_shared, 0xff,
           (size_t)(__stop_pensieve_emu_shared - __start_pensieve_emu_shared));
}
#endif

bool run_block(int schedule, std::mt19937_64& rng) {
    if (__start_pensieve_emu_shared != nullptr) poison_shared();
    if (RUN->dynamic != nullptr) memset(RUN->dynamic, 0xff, RUN->dynamic_bytes);
    for (Fiber& f : RUN->fibers) {
        f.state = State::Ready;
        f.barriers = f.collectives = 0;
        f.file = nullptr;
        f.line = 0;
        f.open.clear();
        f.pending.clear();
        start_context(f.context, f.stack, STACK, fiber_main);
    }
    for (;;) {
        bool progressed = false;
        for (unsigned id : order(schedule, rng)) {
            Fiber& f = RUN->fibers[id];
            if (f.state != State::Ready) continue;
            enter(f);
            progressed = true;
        }
        if (!settle_warps(progressed)) return false;
        if (progressed) continue;
        bool all_done = false;
        if (!settle_block(all_done)) return false;
        if (all_done) return RUN->error.empty();
    }
}

}  // namespace

dim3 thread_idx() {
    const Fiber& f = self();
    const dim3 b = RUN->block;
    return dim3{f.tid % b.x, f.tid / b.x % b.y, f.tid / (b.x * b.y)};
}
dim3 block_idx() { return (void)self(), RUN->block_idx; }
dim3 block_dim() { return (void)self(), RUN->block; }
dim3 grid_dim() { return (void)self(), RUN->grid; }
unsigned char* dynamic_shared() { return (void)self(), RUN->dynamic; }

void syncthreads(const char* file, int line) {
    Fiber& f = self();
    f.state = State::AtBarrier;
    f.file = file;
    f.line = line;
    park(f);
}

uint32_t collective(Collective kind, unsigned mask, uint32_t value, int arg, const char* file,
                    int line) {
    Fiber& f = self();
    f.state = State::AtCollective;
    f.kind = kind;
    f.mask = mask;
    f.value = value;
    f.arg = arg;
    f.file = file;
    f.line = line;
    park(f);
    return f.result;
}

void async_copy(void* dst, const void* src, size_t size, size_t zfill) {
    Fiber& f = self();
    const bool valid = (size == 4 || size == 8 || size == 16) && zfill <= size &&
                       (uintptr_t)dst % size == 0 && (uintptr_t)src % size == 0;
    if (!valid) {
        // The first such copy is reported once the block ends; none of them is made.
        if (RUN->error.empty()) {
            char buf[192];
            snprintf(buf, sizeof buf,
                     "thread %u: an asynchronous copy of %zu bytes (zero-filled %zu) from %p to "
                     "%p (4, 8 or 16 bytes, both addresses aligned to it)",
                     f.tid, size, zfill, src, dst);
            RUN->error = buf;
        }
        return;
    }
    Copy c{static_cast<unsigned char*>(dst), std::vector<unsigned char>(size, 0)};
    memcpy(c.bytes.data(), src, size - zfill);
    f.open.push_back(std::move(c));
}

void async_commit() {
    Fiber& f = self();
    f.pending.push_back(std::move(f.open));
    f.open.clear();
}

void async_wait(size_t prior) {
    Fiber& f = self();
    while (f.pending.size() > prior) {
        for (const Copy& c : f.pending.front()) memcpy(c.dst, c.bytes.data(), c.bytes.size());
        f.pending.pop_front();
    }
}

void matrix_collective(MatrixOp* op, const char* file, int line) {
    self().op = op;
    collective(Collective::Matrix, 0xffffffffu, 0, 0, file, line);
}

}  // namespace pensieve_emu

using namespace pensieve_emu;

// Runs `body(ctx)` as every thread of a grid of `grid` blocks of `block` threads (x, y, z),
// each with `dynamic_shared` bytes of dynamic shared memory, one block at a time, under
// `schedule` (see `order`; `seed` for the random one). Returns 0, or -1 with a report in
// `report` (NUL-terminated, at most `report_len` bytes).
extern "C" int pensieve_emu_launch(const unsigned grid[3], const unsigned block[3],
                                   size_t dynamic_shared, int schedule, uint64_t seed,
                                   void (*body)(void*), void* ctx, char* report,
                                   size_t report_len) {
    std::lock_guard<std::mutex> lock(RUNS);
    Run run;
    run.grid = dim3{grid[0], grid[1], grid[2]};
    run.block = dim3{block[0], block[1], block[2]};
    run.body = body;
    run.ctx = ctx;
    const size_t threads = (size_t)block[0] * block[1] * block[2];
    if (threads == 0 || threads > 1024) {
        snprintf(report, report_len, "a block of %zu threads (CUDA allows 1 to 1024)", threads);
        return -1;
    }
    // CUDA's limit per block on the GPUs the kernels are built for (sm_90: 227 KiB).
    if (dynamic_shared > 227 * 1024 || dynamic_shared % 16 != 0) {
        snprintf(report, report_len,
                 "%zu bytes of dynamic shared memory (a multiple of 16, at most 227 KiB)",
                 dynamic_shared);
        return -1;
    }
    if (dynamic_shared > 0) {
        const size_t page = 4096, pages = (dynamic_shared + page - 1) / page * page;
        run.mapped = pages + page;
        run.mapping = mmap(nullptr, run.mapped, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (run.mapping == MAP_FAILED) {
            snprintf(report, report_len, "no memory for the dynamic shared memory");
            return -1;
        }
        char* guard = static_cast<char*>(run.mapping) + pages;
        mprotect(guard, page, PROT_NONE);
        run.dynamic = reinterpret_cast<unsigned char*>(guard - dynamic_shared);
        run.dynamic_bytes = dynamic_shared;
    }
    run.fibers.resize(threads);
    for (size_t t = 0; t < threads; ++t) {
        void* stack = mmap(nullptr, STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                           -1, 0);
        if (stack == MAP_FAILED) {
            for (size_t u = 0; u < t; ++u) munmap(run.fibers[u].stack, STACK);
            if (run.mapping != nullptr) munmap(run.mapping, run.mapped);
            snprintf(report, report_len, "no memory for the fibers' stacks");
            return -1;
        }
        mprotect(stack, 4096, PROT_NONE);  // a guard page below each stack
        run.fibers[t].stack = static_cast<char*>(stack);
        run.fibers[t].tid = (unsigned)t;
    }
    RUN = &run;
    std::mt19937_64 rng(seed);
    bool ok = true;
    for (unsigned z = 0; ok && z < grid[2]; ++z)
        for (unsigned y = 0; ok && y < grid[1]; ++y)
            for (unsigned x = 0; ok && x < grid[0]; ++x) {
                run.block_idx = dim3{x, y, z};
                ok = run_block(schedule, rng);
            }
    RUN = nullptr;
    for (Fiber& f : run.fibers) {
#ifdef PENSIEVE_EMU_ASAN
        // A fiber stopped by a report leaves its frames' poison behind.
        __asan_unpoison_memory_region(f.stack, STACK);
#endif
        munmap(f.stack, STACK);
    }
    if (run.mapping != nullptr) munmap(run.mapping, run.mapped);
    if (!ok) snprintf(report, report_len, "%s", run.error.c_str());
    return ok ? 0 : -1;
}
