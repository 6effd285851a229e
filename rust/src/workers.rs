//! The CPU kernels' threads: one rayon pool per thread count, started on first use and kept
//! for the life of the process. A decode step makes several parallel kernel calls per layer,
//! each too short to pay for starting threads (a scoped spawn and join costs about as much as
//! the work it shares at that size); the pool's threads wait between calls, spinning briefly
//! before they sleep, and pick the next call up at once.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// `run` over `items` on up to `threads` threads, each taking items one at a time from a
/// shared queue: a thread the OS preempts holds up none of the others' work (a static split
/// would wait for it). On one thread, `run` gets them all in order.
pub fn take_in_turn<'a, I: Send>(threads: usize, items: &'a mut [I], run: &(dyn Fn(&mut dyn Iterator<Item = &'a mut I>) + Sync)) {
    if threads <= 1 {
        run(&mut items.iter_mut());
        return;
    }
    let queue = Mutex::new(items.iter_mut());
    let next = || queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).next();
    run_on_threads(threads, &|| run(&mut std::iter::from_fn(next)));
}

/// Runs `work` on the calling thread and on `threads - 1` pool threads at the same time, and
/// returns when every copy has returned. The copies share the work themselves (typically
/// from a shared counter or queue, so a thread the OS preempts holds up none of the others').
/// A panic in any copy is raised here once all are done.
pub fn run_on_threads(threads: usize, work: &(dyn Fn() + Sync)) {
    if threads <= 1 {
        work();
        return;
    }
    pool(threads - 1).in_place_scope(|scope| {
        for _ in 1..threads {
            scope.spawn(|_| work());
        }
        work();
    });
}

/// The pool of `size` threads, built on first use.
fn pool(size: usize) -> &'static rayon::ThreadPool {
    static POOLS: OnceLock<Mutex<HashMap<usize, &'static rayon::ThreadPool>>> = OnceLock::new();
    let mut pools = POOLS.get_or_init(Mutex::default).lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    pools.entry(size).or_insert_with(|| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(size)
            .thread_name(|i| format!("r3srv-kernel-{i}"))
            .build()
            .expect("could not start the CPU kernels' threads");
        Box::leak(Box::new(pool))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_copy_runs_once_and_the_work_is_shared() {
        for threads in [1, 2, 3] {
            let (copies, next, done) = (AtomicUsize::new(0), AtomicUsize::new(0), AtomicUsize::new(0));
            run_on_threads(threads, &|| {
                copies.fetch_add(1, Ordering::Relaxed);
                while next.fetch_add(1, Ordering::Relaxed) < 1000 {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            });
            assert_eq!(copies.load(Ordering::Relaxed), threads);
            assert_eq!(done.load(Ordering::Relaxed), 1000);
        }
    }

    #[test]
    fn a_panicking_copy_is_raised_to_the_caller() {
        let caught = std::panic::catch_unwind(|| {
            let first = AtomicUsize::new(0);
            run_on_threads(2, &|| {
                if first.fetch_add(1, Ordering::Relaxed) == 1 {
                    panic!("one copy fails");
                }
            });
        });
        assert!(caught.is_err());
        // the pool still serves later calls
        let copies = AtomicUsize::new(0);
        run_on_threads(2, &|| {
            copies.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(copies.load(Ordering::Relaxed), 2);
    }
}
