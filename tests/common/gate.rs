//! Holding a call at a failpoint, to make a race certain instead of hoped
//! for: a [`Gate`] is a failpoint armed with a callback
//! (`fail::cfg_callback`) that holds the n-th call reaching it until the
//! test opens it, while every other call passes. The held call runs on a
//! thread of its own with its own runtime ([`Call`]). Failpoints armed in
//! process are process-global: only a test binary of its own may use these,
//! one test at a time ([`failpoints_and_runtime`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Default)]
struct GateState {
    hits: u32,
    open: bool,
}

/// A failpoint that holds the `nth` call reaching it (counting from 1)
/// until [`Gate::open`]; every other call passes at once. `nth = 0` holds
/// nothing and only counts. Dropping the gate opens it and disarms the
/// failpoint, so a failing test never leaves a thread held.
pub struct Gate {
    name: &'static str,
    nth: u32,
    state: Arc<(Mutex<GateState>, Condvar)>,
}

impl Gate {
    pub fn hold(name: &'static str, nth: u32) -> Gate {
        let state = Arc::new((Mutex::new(GateState::default()), Condvar::new()));
        let shared = state.clone();
        fail::cfg_callback(name, move || {
            let (lock, cv) = &*shared;
            let mut g = lock.lock().unwrap_or_else(|e| e.into_inner());
            g.hits += 1;
            if g.hits != nth {
                return;
            }
            cv.notify_all();
            while !g.open {
                g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        })
        .unwrap();
        Gate { name, nth, state }
    }

    /// Counts the calls reaching `name`, holding none.
    pub fn count(name: &'static str) -> Gate {
        Gate::hold(name, 0)
    }

    pub fn hits(&self) -> u32 {
        self.state.0.lock().unwrap_or_else(|e| e.into_inner()).hits
    }

    /// Waits until the `nth` call is held here; fails when `call` ended first.
    pub fn wait_held<T: std::fmt::Debug + Send + 'static>(&self, call: &mut Call<T>) {
        assert!(self.nth > 0, "gate {} holds nothing", self.name);
        let deadline = Instant::now() + Duration::from_secs(60);
        let (lock, cv) = &*self.state;
        let mut g = lock.lock().unwrap_or_else(|e| e.into_inner());
        while g.hits < self.nth {
            if call.is_finished() {
                drop(g);
                let r = call.join();
                panic!("the call ended before failpoint {} held it: {r:?}", self.name);
            }
            assert!(Instant::now() < deadline, "no call was held at failpoint {} within 60 s", self.name);
            g = cv.wait_timeout(g, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    pub fn open(&self) {
        let (lock, cv) = &*self.state;
        lock.lock().unwrap_or_else(|e| e.into_inner()).open = true;
        cv.notify_all();
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.open();
        fail::remove(self.name);
    }
}

/// A step running on a thread of its own, with its own runtime, so a gate
/// holding its thread holds nothing of the test's.
pub struct Call<T> {
    handle: Option<JoinHandle<T>>,
}

impl<T: Send + 'static> Call<T> {
    pub fn start<F, Fut>(f: F) -> Call<T>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T>,
    {
        let handle = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
            rt.block_on(f())
        });
        Call { handle: Some(handle) }
    }

    pub fn is_finished(&self) -> bool {
        self.handle.as_ref().is_none_or(|h| h.is_finished())
    }

    pub fn join(&mut self) -> T {
        match self.handle.take().expect("a call is joined once").join() {
            Ok(v) => v,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

/// A test's hold on the process's failpoints (one test at a time, cleared
/// when it ends) and the test's own runtime.
pub fn failpoints_and_runtime() -> (fail::FailScenario<'static>, tokio::runtime::Runtime) {
    let fp = fail::FailScenario::setup();
    (fp, tokio::runtime::Runtime::new().unwrap())
}

/// Starts `step` on the workflow file `wf` as a [`Call`] and waits until
/// `gate` (armed before, with any other gate the call meets) holds it.
pub fn start_held<T, F, Fut>(gate: &Gate, wf: &Path, step: F) -> Call<T>
where
    T: std::fmt::Debug + Send + 'static,
    F: FnOnce(PathBuf) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
{
    let wf = wf.to_path_buf();
    let mut call = Call::start(move || step(wf));
    gate.wait_held(&mut call);
    call
}

pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}
