//! A small persistent thread pool: the caller's thread works too, workers spin briefly between
//! jobs (a forward pass issues hundreds of `run` calls per token) and then park.

use std::any::Any;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker spins before parking. Long enough to bridge the gap between two
/// matmuls of one forward pass (a few microseconds of norms and quantization at decode), short
/// enough not to burn a core others need: while a streamed layer waits ~1 ms for expert reads,
/// 300 µs of spinning cost ~25% more CPU per token for the same speed (expert_stream_bench).
const SPIN_TIME: Duration = Duration::from_micros(50);

/// Floats of cheap element-wise work (quantizing activations, norms) below which spreading it
/// over the pool costs more than it saves: a decode step's rows stay on the calling thread.
pub(crate) const WORTH_SHARING: usize = 1 << 15;

// `state` packs (generation, n_tasks, next_task) so that claiming a task and checking that it
// belongs to the current job is one compare-and-swap: a late worker can never claim a task of a
// job it did not see published.
const IDX_BITS: u32 = 20;
const IDX_MASK: u64 = (1 << IDX_BITS) - 1;
const MAX_TASKS: usize = IDX_MASK as usize;
const GEN_SHIFT: u32 = 2 * IDX_BITS;

fn pack(generation: u64, n_tasks: usize, next: usize) -> u64 {
    (generation << GEN_SHIFT) | ((n_tasks as u64) << IDX_BITS) | next as u64
}

struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
}

struct Slot {
    sleeping: AtomicBool,
    thread: OnceLock<Thread>,
}

struct Shared {
    state: AtomicU64,
    /// Points at the caller's `Job` while a job is live; only dereferenced after claiming a task,
    /// which guarantees the caller is still inside `run`.
    job: AtomicPtr<Job<'static>>,
    done: AtomicUsize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    shutdown: AtomicBool,
    slots: Vec<Slot>,
}

impl Shared {
    /// Claims and runs tasks of job `generation` until none is left.
    fn work(&self, generation: u64) {
        loop {
            let s = self.state.load(Ordering::Acquire);
            if s >> GEN_SHIFT != generation {
                return;
            }
            let n = ((s >> IDX_BITS) & IDX_MASK) as usize;
            let idx = (s & IDX_MASK) as usize;
            if idx >= n {
                return;
            }
            if self
                .state
                .compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            // SAFETY: task `idx` of this generation is claimed but not done, so the caller is
            // still blocked in `run` and the `Job` it points at is alive.
            let job = unsafe { &*self.job.load(Ordering::Acquire) };
            if let Err(p) = panic::catch_unwind(AssertUnwindSafe(|| (job.f)(idx))) {
                let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                slot.get_or_insert(p);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

/// Persistent worker threads; `run` executes a batch of indexed tasks and returns when all are
/// done. The calling thread takes part, so `n_threads` counts it.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises jobs; a `run` that finds it taken (nested or concurrent use) runs inline.
    run_lock: Mutex<()>,
    generation: AtomicU64,
}

impl ThreadPool {
    /// `n_threads` total including the caller (0 is treated as 1; 1 spawns no workers).
    pub fn new(n_threads: usize) -> Self {
        let n_workers = n_threads.max(1) - 1;
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
            shutdown: AtomicBool::new(false),
            slots: (0..n_workers)
                .map(|_| Slot {
                    sleeping: AtomicBool::new(false),
                    thread: OnceLock::new(),
                })
                .collect(),
        });
        let workers = (0..n_workers)
            .map(|i| {
                let shared = Arc::clone(&shared);
                thread::Builder::new()
                    .name(format!("tessera-worker-{i}"))
                    .spawn(move || worker_loop(&shared, i))
                    .expect("failed to spawn a thread-pool worker")
            })
            .collect::<Vec<_>>();
        for (slot, w) in shared.slots.iter().zip(&workers) {
            let _ = slot.thread.set(w.thread().clone());
        }
        Self {
            shared,
            workers,
            run_lock: Mutex::new(()),
            generation: AtomicU64::new(0),
        }
    }

    /// Threads that execute tasks, the caller included.
    pub fn n_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(task_index)` for every index in `0..n_tasks` across the threads; returns when all
    /// are done. A panic in any task is re-raised here after every task has finished.
    pub fn run<F: Fn(usize) + Sync>(&self, n_tasks: usize, f: F) {
        if n_tasks == 0 {
            return;
        }
        if self.workers.is_empty() || n_tasks == 1 {
            (0..n_tasks).for_each(f);
            return;
        }
        // Nested or concurrent use: do the work on this thread rather than wait or deadlock.
        let Ok(_guard) = self.run_lock.try_lock() else {
            (0..n_tasks).for_each(f);
            return;
        };
        if n_tasks > MAX_TASKS {
            // Split oversized jobs into rounds that fit the packed counter.
            let mut start = 0;
            while start < n_tasks {
                let len = (n_tasks - start).min(MAX_TASKS);
                self.run_job(len, &|i| f(start + i));
                start += len;
            }
            return;
        }
        self.run_job(n_tasks, &f);
    }

    fn run_job(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let sh = &*self.shared;
        let generation = (self.generation.fetch_add(1, Ordering::Relaxed) + 1) & ((1 << 24) - 1);
        let job = Job { f };
        // SAFETY (lifetime erasure): workers only dereference this pointer after claiming a task
        // of this generation, and we do not return before every task is done.
        sh.job.store(
            &job as *const Job<'_> as *mut Job<'static>,
            Ordering::Release,
        );
        sh.done.store(0, Ordering::Relaxed);
        sh.state
            .store(pack(generation, n_tasks, 0), Ordering::SeqCst);
        for slot in &sh.slots {
            if slot.sleeping.swap(false, Ordering::SeqCst) {
                if let Some(t) = slot.thread.get() {
                    t.unpark();
                }
            }
        }
        sh.work(generation);
        let mut spins = 0u32;
        while sh.done.load(Ordering::Acquire) < n_tasks {
            spins += 1;
            if spins < 1 << 14 {
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
        }
        sh.job.store(std::ptr::null_mut(), Ordering::Relaxed);
        let p = sh.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(p) = p {
            panic::resume_unwind(p);
        }
    }
}

fn worker_loop(sh: &Shared, idx: usize) {
    let slot = &sh.slots[idx];
    let mut seen = sh.state.load(Ordering::Acquire) >> GEN_SHIFT;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        let generation = loop {
            let g = sh.state.load(Ordering::Acquire) >> GEN_SHIFT;
            if g != seen {
                break g;
            }
            if sh.shutdown.load(Ordering::Acquire) {
                return;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(256) || start.elapsed() < SPIN_TIME {
                std::hint::spin_loop();
                continue;
            }
            // Announce sleep, then re-check: `run` bumps `state` before swapping `sleeping`, so
            // either we see the new generation here or it sees our flag and unparks us.
            slot.sleeping.store(true, Ordering::SeqCst);
            let g = sh.state.load(Ordering::SeqCst) >> GEN_SHIFT;
            if g != seen || sh.shutdown.load(Ordering::SeqCst) {
                slot.sleeping.store(false, Ordering::SeqCst);
                continue;
            }
            thread::park();
            slot.sleeping.store(false, Ordering::SeqCst);
        };
        seen = generation;
        sh.work(generation);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        for w in &self.workers {
            w.thread().unpark();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.n_threads())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn runs_every_task_once() {
        for n_threads in 1..=4 {
            let pool = ThreadPool::new(n_threads);
            for n_tasks in [0, 1, 2, 3, 7, 100] {
                let hits: Vec<AtomicU32> = (0..n_tasks).map(|_| AtomicU32::new(0)).collect();
                pool.run(n_tasks, |i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn many_small_jobs_and_sleep() {
        let pool = Arc::new(ThreadPool::new(3));
        let total = AtomicUsize::new(0);
        for round in 0..2000 {
            pool.run(round % 5, |i| {
                total.fetch_add(i + 1, Ordering::Relaxed);
            });
            if round % 500 == 0 {
                // Let workers park, then wake them again.
                thread::sleep(Duration::from_millis(2));
            }
        }
        let expect: usize = (0..2000).map(|r| (1..=r % 5).sum::<usize>()).sum();
        assert_eq!(total.load(Ordering::Relaxed), expect);
    }

    #[test]
    fn nested_and_concurrent_runs_do_not_deadlock() {
        let pool = Arc::new(ThreadPool::new(2));
        let count = AtomicUsize::new(0);
        pool.run(4, |_| {
            pool.run(3, |_| {
                count.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(count.load(Ordering::Relaxed), 12);
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let pool = Arc::clone(&pool);
                thread::spawn(move || {
                    let c = AtomicUsize::new(0);
                    for _ in 0..200 {
                        pool.run(5, |_| {
                            c.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                    c.load(Ordering::Relaxed)
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), 1000);
        }
    }

    #[test]
    fn panic_propagates_after_all_tasks() {
        let pool = ThreadPool::new(2);
        let done = AtomicUsize::new(0);
        let r = panic::catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, |i| {
                done.fetch_add(1, Ordering::Relaxed);
                if i == 3 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        assert_eq!(done.load(Ordering::Relaxed), 8);
        // The pool still works afterwards.
        let c = AtomicUsize::new(0);
        pool.run(5, |_| {
            c.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(c.load(Ordering::Relaxed), 5);
    }
}
