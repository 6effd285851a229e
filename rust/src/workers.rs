//! The CPU kernels' threads: one rayon pool per thread count, started on first use and kept
//! for the life of the process. A decode step makes several parallel kernel calls per layer,
//! each too short to pay for starting threads (a scoped spawn and join costs about as much as
//! the work it shares at that size); the pool's threads wait between calls, spinning briefly
//! before they sleep, and pick the next call up at once.
//!
//! Or, once `use_openmp` names the process's libgomp (torch's), the OpenMP team of the calling
//! thread: the threads torch's own ops run on. Two pools on the same cores fight where the
//! OpenMP threads spin after each torch op (libgomp's default wait): a kernel's second thread
//! then shares a core with a spinning one, and torch's next op with rayon's spinning threads.
//! One team has nothing to fight.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// `run` over `items` on up to `threads` threads, each taking items one at a time from a
/// shared queue: a thread the OS preempts holds up none of the others' work (a static split
/// would wait for it). On one thread, `run` gets them all in order.
pub fn take_in_turn<'a, I: Send>(
    threads: usize,
    items: &'a mut [I],
    run: &(dyn Fn(&mut dyn Iterator<Item = &'a mut I>) + Sync),
) {
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
    if let Some(team) = openmp::team() {
        return team.run(threads, work);
    }
    pool(threads - 1).in_place_scope(|scope| {
        for _ in 1..threads {
            scope.spawn(|_| work());
        }
        work();
    });
}

/// Makes the kernels run on the OpenMP team of the libgomp at `path` (loaded in this process
/// already: torch's), or on the rayon pool again (None).
pub fn use_openmp(path: Option<&str>) -> Result<(), String> {
    openmp::choose(path)
}

/// Whether the kernels run on an OpenMP team (`use_openmp`).
pub fn on_openmp() -> bool {
    openmp::team().is_some()
}

mod openmp {
    use std::any::Any;
    use std::ffi::{c_uint, c_void, CString};
    use std::sync::atomic::{AtomicPtr, Ordering};
    use std::sync::Mutex;

    type Parallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);

    /// libgomp's entry for a parallel region (what `#pragma omp parallel` compiles to): runs
    /// fn(data) on the calling thread and num_threads - 1 of its team, returns when all have.
    #[derive(Clone, Copy)]
    pub(super) struct Team {
        parallel: Parallel,
    }

    /// The chosen team's GOMP_parallel, null for the rayon pool: read on every parallel call.
    static PARALLEL: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

    pub(super) fn team() -> Option<Team> {
        let symbol = PARALLEL.load(Ordering::Acquire);
        // SAFETY: a non-null value is GOMP_parallel's address (`find`), valid for the process.
        (!symbol.is_null()).then(|| Team { parallel: unsafe { std::mem::transmute::<*mut c_void, Parallel>(symbol) } })
    }

    pub(super) fn choose(path: Option<&str>) -> Result<(), String> {
        let symbol = path.map(find).transpose()?.unwrap_or(std::ptr::null_mut());
        PARALLEL.store(symbol, Ordering::Release);
        Ok(())
    }

    /// GOMP_parallel's address in the libgomp at `path`, which must be loaded already
    /// (RTLD_NOLOAD: a second copy would be a second team).
    fn find(path: &str) -> Result<*mut c_void, String> {
        let name = CString::new(path).map_err(|_| format!("{path:?}: not a path"))?;
        // SAFETY: dlopen and dlsym are given NUL-terminated strings; the handle is never closed,
        // so the symbol stays valid for the life of the process.
        unsafe {
            let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
            if handle.is_null() {
                return Err(format!("{path}: not a library loaded in this process"));
            }
            let symbol = libc::dlsym(handle, c"GOMP_parallel".as_ptr());
            if symbol.is_null() {
                return Err(format!("{path}: no GOMP_parallel (not GNU OpenMP)"));
            }
            Ok(symbol)
        }
    }

    /// One region's work and the first panic of any thread running it.
    struct Region<'a> {
        work: &'a (dyn Fn() + Sync),
        panic: Mutex<Option<Box<dyn Any + Send>>>,
    }

    extern "C" fn each_thread(data: *mut c_void) {
        // SAFETY: `run` passes a Region that outlives the region's threads.
        let region = unsafe { &*(data as *const Region<'_>) };
        // a panic must not unwind into libgomp's C frames: kept, raised by the caller
        if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(region.work)) {
            region.panic.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).get_or_insert(panic);
        }
    }

    impl Team {
        /// `work` on up to `threads` threads of the calling thread's team (fewer where OpenMP
        /// gives fewer, e.g. inside another parallel region: the copies share the work anyway).
        pub(super) fn run(self, threads: usize, work: &(dyn Fn() + Sync)) {
            let region = Region { work, panic: Mutex::new(None) };
            // SAFETY: GOMP_parallel returns once every thread has left each_thread, so the
            // region outlives them.
            unsafe { (self.parallel)(each_thread, &region as *const Region<'_> as *mut c_void, threads as c_uint, 0) };
            if let Some(panic) = region.panic.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner()) {
                std::panic::resume_unwind(panic);
            }
        }
    }
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

#[cfg(feature = "python")]
pub(crate) mod python {
    use pyo3::exceptions::PyValueError;
    use pyo3::prelude::*;

    /// The kernels' threads: the OpenMP team of the loaded libgomp at `path`, or the rayon pool
    /// (None). A path that is not a loaded GNU OpenMP is a ValueError, and nothing changes.
    #[pyfunction]
    #[pyo3(signature = (path=None))]
    pub fn use_openmp_threads(path: Option<&str>) -> PyResult<()> {
        super::use_openmp(path).map_err(PyValueError::new_err)
    }

    /// "openmp" or "rayon": the threads the kernels run on.
    #[pyfunction]
    pub fn kernel_threads() -> &'static str {
        if super::on_openmp() {
            "openmp"
        } else {
            "rayon"
        }
    }
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

    /// Both tests' checks on the OpenMP team of the system's libgomp (loaded here first, as torch
    /// loads its own), then on the rayon pool again. Other tests running meanwhile take the team
    /// too, which they may: every kernel computes the same bits on either.
    #[test]
    fn the_openmp_team_runs_every_copy_and_raises_a_panic() {
        let name = c"libgomp.so.1";
        // SAFETY: a NUL-terminated name; the library stays loaded for the process.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW) };
        assert!(!handle.is_null(), "libgomp.so.1 (GCC's OpenMP, installed with gcc) did not load");
        assert!(use_openmp(Some("/no/such/libgomp.so.1")).is_err());
        assert!(!on_openmp(), "a refused path leaves the pool as it was");
        use_openmp(Some("libgomp.so.1")).unwrap();
        assert!(on_openmp());
        every_copy_runs_once_and_the_work_is_shared();
        a_panicking_copy_is_raised_to_the_caller();
        use_openmp(None).unwrap();
        assert!(!on_openmp());
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
