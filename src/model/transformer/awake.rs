//! Keeping the pool's other workers awake through a forward pass.
//!
//! A decode step forks five parallel regions per layer (Q/K/V, attention, the output
//! projection, gate/up, down). Between two, rayon's idle workers go to sleep, and waking one
//! for the next region costs more than a small region's work. So while a pass runs, each
//! other worker runs a job that takes the pool's work as it appears and yields to the OS
//! between (a spin would take the core from another process), until the pass ends.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

thread_local! {
    /// Whether this thread is inside a pass: running it, or kept awake beside one. A job
    /// that would keep it awake for another pass returns at once: a thread waiting for one
    /// pass to end while a pass of its own waits beneath would let two such threads wait on
    /// each other for ever.
    static IN_PASS: Cell<bool> = const { Cell::new(false) };
}

/// Runs `pass` on a worker of rayon's pool with the other workers kept awake until it ends.
pub(super) fn run<T: Send>(pass: impl FnOnce() -> T + Send) -> T {
    let done = &AtomicBool::new(false);
    rayon::scope(|s| {
        for _ in 1..rayon::current_num_threads() {
            s.spawn(move |_| keep_awake(done));
        }
        let _end = PassEnd {
            done,
            outer: IN_PASS.replace(true),
        };
        pass()
    })
}

/// Takes the pool's jobs, or yields to the OS, until `done`; returns at once on a thread
/// already inside a pass.
fn keep_awake(done: &AtomicBool) {
    if IN_PASS.replace(true) {
        return;
    }
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            // The OS's yield, not a spin: a thread of another process (a second engine, the
            // host app) that waits for this core gets it.
            std::thread::yield_now();
        }
    }
    IN_PASS.set(false);
}

/// Ends a pass for the workers kept awake beside it, however it ends: the scope waits for
/// them, a panic's unwinding too.
struct PassEnd<'a> {
    done: &'a AtomicBool,
    outer: bool,
}

impl Drop for PassEnd<'_> {
    fn drop(&mut self) {
        IN_PASS.set(self.outer);
        self.done.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::run;

    #[test]
    fn passes_nested_and_side_by_side_end() {
        // Passes from several threads at once, each with a parallel op and a pass inside: no
        // worker is left spinning for a pass that ended, none waits on another for ever.
        let sums: Vec<u64> = std::thread::scope(|s| {
            let passes: Vec<_> = (0..4u64)
                .map(|i| {
                    s.spawn(move || {
                        (0..50)
                            .map(|_| {
                                run(|| {
                                    use rayon::prelude::*;
                                    let inner = run(|| (0..1000u64).into_par_iter().sum::<u64>());
                                    inner + (0..1000u64).into_par_iter().map(|x| x * i).sum::<u64>()
                                })
                            })
                            .sum()
                    })
                })
                .collect();
            passes.into_iter().map(|p| p.join().unwrap()).collect()
        });
        for (i, sum) in sums.into_iter().enumerate() {
            assert_eq!(sum, 50 * (499_500 + 499_500 * i as u64));
        }
    }

    #[test]
    fn a_panicking_pass_ends_its_workers() {
        let caught = std::panic::catch_unwind(|| run(|| panic!("a pass that fails")));
        assert!(caught.is_err());
        assert_eq!(run(|| 7), 7);
    }
}
