//! Tracer threads: a frozen tree (a [`crate::capture::Held`]) or a
//! rebuilt one (a [`crate::restore::Ready`]) on a thread of its own, so
//! that several trees are frozen, dumped, rebuilt and let go at once.
//!
//! ptrace ties every traced thread to the thread that seized it: only that
//! thread may wait for it, inject into it or detach it, and when that
//! thread exits the kernel detaches its tracees (or kills those seized
//! with `PTRACE_O_EXITKILL`, the restore's stubs). So a [`Tracer`] makes
//! its value on its own thread and never lets it leave: the caller sends
//! it closures ([`Tracer::run`], [`Tracer::end`]), which run there, one at
//! a time, in order. Dropping a `Tracer` drops the value on its thread
//! (a `Held` aborts: its processes run on; a `Ready` kills its stubs) and
//! waits for that; [`end_all`] does it for many at once.
//!
//! The work that copies pages is bounded by the page workers' pool
//! (`kinds::memory::pool`, one per CPU); a [`Gate`] bounds how many trees
//! do the rest of their work (ptrace round trips, /proc reads, image
//! writes and their fsyncs) at once; a [`Rendezvous`] holds several trees
//! at one point until each has reached it or given up; a [`Go`] holds
//! them, once ready, until someone else gives the signal.

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// A job for the tracer's thread: gets the value (None once ended).
type Job<T> = Box<dyn FnOnce(&mut Option<T>) + Send>;

/// The thread of a tracer ended (it panicked) before a job's answer.
#[derive(Debug, thiserror::Error)]
#[error("the tracer thread {0} ended (panicked) before answering")]
pub struct Gone(pub String);

/// A value living on a thread of its own (see the module docs).
pub struct Tracer<T> {
    name: String,
    tx: Option<mpsc::Sender<Job<T>>>,
    thread: Option<JoinHandle<()>>,
}

/// A tracer whose value is being made: [`Starting::join`] says how it went.
pub struct Starting<T, E> {
    tracer: Tracer<T>,
    made: mpsc::Receiver<Result<(), E>>,
}

/// The answer to come of a job sent to a tracer.
pub struct Pending<R> {
    name: String,
    rx: mpsc::Receiver<R>,
}

impl<R> Pending<R> {
    /// Wait for the answer (the job's own work carries its bounds: every
    /// wait on a traced thread has a deadline).
    pub fn wait(self) -> Result<R, Gone> {
        self.rx.recv().map_err(|_| Gone(self.name))
    }
}

impl<T: 'static> Tracer<T> {
    /// Start thread `name` making its value with `make` (freezing a tree,
    /// rebuilding one); returns at once.
    pub fn start<E: Send + 'static>(
        name: String,
        make: impl FnOnce() -> Result<T, E> + Send + 'static,
    ) -> std::io::Result<Starting<T, E>> {
        let (tx, rx) = mpsc::channel::<Job<T>>();
        let (made_tx, made) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let mut value = match make() {
                    Ok(v) => Some(v),
                    Err(e) => {
                        let _ = made_tx.send(Err(e));
                        return;
                    }
                };
                let _ = made_tx.send(Ok(()));
                while value.is_some() {
                    match rx.recv() {
                        Ok(job) => job(&mut value),
                        Err(_) => break,
                    }
                }
                // Dropped here, on the thread that traces it.
                drop(value);
            })?;
        Ok(Starting {
            tracer: Tracer {
                name,
                tx: Some(tx),
                thread: Some(thread),
            },
            made,
        })
    }

    /// Run `f` on the value, on its thread; the answer comes through the
    /// [`Pending`] (so that several tracers work at once).
    pub fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut T) -> R + Send + 'static,
    ) -> Pending<R> {
        self.send(move |v| v.as_mut().map(f))
    }

    /// Hand the value to `f` on its thread (letting it go: the thread
    /// ends after); the answer comes through the [`Pending`].
    pub fn end<R: Send + 'static>(mut self, f: impl FnOnce(T) -> R + Send + 'static) -> Pending<R> {
        let p = self.send(move |v| v.take().map(f));
        // The thread ends with the job: nothing to drop, no need to wait.
        self.tx = None;
        self.thread = None;
        p
    }

    fn send<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Option<T>) -> Option<R> + Send + 'static,
    ) -> Pending<R> {
        let (tx, rx) = mpsc::channel();
        if let Some(jobs) = &self.tx {
            let _ = jobs.send(Box::new(move |v: &mut Option<T>| {
                if let Some(r) = f(v) {
                    let _ = tx.send(r);
                }
            }));
        }
        Pending {
            name: self.name.clone(),
            rx,
        }
    }

    /// Tell the thread to drop its value and end, without waiting.
    fn close(&mut self) -> Option<JoinHandle<()>> {
        self.tx = None;
        self.thread.take()
    }
}

impl<T, E> Starting<T, E> {
    /// The tracer once its value is made, or why it could not be.
    pub fn join(self) -> Result<Tracer<T>, Result<E, Gone>> {
        match self.made.recv() {
            Ok(Ok(())) => Ok(self.tracer),
            Ok(Err(e)) => Err(Ok(e)),
            Err(_) => Err(Err(Gone(self.tracer.name.clone()))),
        }
    }
}

impl<T> Drop for Tracer<T> {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Drop every tracer's value at once, each on its thread, and wait until
/// all are dropped (an abort thaws every tree at the same time).
pub fn end_all<T: 'static>(tracers: impl IntoIterator<Item = Tracer<T>>) {
    let threads: Vec<JoinHandle<()>> = tracers.into_iter().filter_map(|mut t| t.close()).collect();
    for t in threads {
        let _ = t.join();
    }
}

/// At most `n` holders at once (a counting semaphore).
pub struct Gate {
    free: Mutex<usize>,
    cv: Condvar,
}

/// A place taken in a [`Gate`], given back on drop.
pub struct Pass<'g>(&'g Gate);

impl Gate {
    pub fn new(n: usize) -> Gate {
        Gate {
            free: Mutex::new(n.max(1)),
            cv: Condvar::new(),
        }
    }

    /// Wait for a free place (each holder's own work is bounded).
    pub fn enter(&self) -> Pass<'_> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        while *free == 0 {
            free = self.cv.wait(free).unwrap_or_else(|p| p.into_inner());
        }
        *free -= 1;
        Pass(self)
    }
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        *self.0.free.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.0.cv.notify_one();
    }
}

/// A meeting point of `n` parties: each waits there ([`Arrival::wait`])
/// until all have arrived. An [`Arrival`] dropped without waiting (its
/// party failed or ended first, its job dropped unrun, its thread
/// panicked) counts as arrived, so nobody waits for a party that will
/// never come; every party's own work is bounded, so the wait is too.
pub struct Rendezvous {
    left: Mutex<usize>,
    cv: Condvar,
}

/// One party's place at a [`Rendezvous`].
pub struct Arrival(Option<Arc<Rendezvous>>);

impl Rendezvous {
    /// A meeting of `n` parties and their `n` arrivals.
    pub fn arrivals(n: usize) -> Vec<Arrival> {
        let r = Arc::new(Rendezvous {
            left: Mutex::new(n),
            cv: Condvar::new(),
        });
        (0..n).map(|_| Arrival(Some(r.clone()))).collect()
    }

    fn arrive(&self) -> std::sync::MutexGuard<'_, usize> {
        let mut left = self.left.lock().unwrap_or_else(|p| p.into_inner());
        *left = left.saturating_sub(1);
        if *left == 0 {
            self.cv.notify_all();
        }
        left
    }
}

impl Arrival {
    /// Arrive, and wait until every other party has arrived (or given up).
    pub fn wait(mut self) {
        if let Some(r) = self.0.take() {
            let mut left = r.arrive();
            while *left > 0 {
                left = r.cv.wait(left).unwrap_or_else(|p| p.into_inner());
            }
        }
    }
}

impl Drop for Arrival {
    fn drop(&mut self) {
        if let Some(r) = self.0.take() {
            drop(r.arrive());
        }
    }
}

/// A start signal for `n` parties that first get ready on their own: each
/// says it is ready and waits there ([`Ticket::wait`]) until the signal
/// is given ([`Go::give`]): go on, or give up. Whoever gives it can first
/// wait until every party is ready or has given up ([`Go::wait_ready`]):
/// a [`Ticket`] dropped without waiting (its party failed first, its
/// thread panicked) counts as ready. Used to freeze the members of every
/// node at once, each node's checks done before the coordinator's FREEZE.
pub struct Go {
    state: Mutex<GoState>,
    cv: Condvar,
}

struct GoState {
    /// Parties ready (or gone).
    ready: usize,
    /// The signal, once given.
    go: Option<bool>,
}

/// One party's place at a [`Go`].
pub struct Ticket(Option<Arc<Go>>);

impl Go {
    /// A signal for `n` parties, and their `n` tickets.
    pub fn new(n: usize) -> (Arc<Go>, Vec<Ticket>) {
        let g = Arc::new(Go {
            state: Mutex::new(GoState { ready: 0, go: None }),
            cv: Condvar::new(),
        });
        let tickets = (0..n).map(|_| Ticket(Some(g.clone()))).collect();
        (g, tickets)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GoState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait until `n` parties are ready (or gone), at most `timeout`:
    /// whether they are.
    pub fn wait_ready(&self, n: usize, timeout: std::time::Duration) -> bool {
        let end = std::time::Instant::now() + timeout;
        let mut st = self.lock();
        while st.ready < n {
            let left = end.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    /// Give the signal: `true` to go on, `false` to give up (a signal
    /// already given stays).
    pub fn give(&self, go: bool) {
        let mut st = self.lock();
        st.go.get_or_insert(go);
        self.cv.notify_all();
    }

    fn arrive(&self) -> std::sync::MutexGuard<'_, GoState> {
        let mut st = self.lock();
        st.ready += 1;
        self.cv.notify_all();
        st
    }
}

impl Ticket {
    /// A ticket of no signal: [`Ticket::wait`] goes on at once.
    pub fn free() -> Ticket {
        Ticket(None)
    }

    /// Say this party is ready and wait for the signal: whether to go on.
    /// The giver's own wait is bounded (it gives up when it stops
    /// waiting), so this wait is too.
    pub fn wait(mut self) -> bool {
        let Some(g) = self.0.take() else {
            return true;
        };
        let mut st = g.arrive();
        loop {
            if let Some(go) = st.go {
                return go;
            }
            st = g.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(g) = self.0.take() {
            drop(g.arrive());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parties wait at a `Go` until it is given; a dropped ticket counts
    /// as ready; the signal given first stays.
    #[test]
    fn go_holds_until_given() {
        let (go, mut tickets) = Go::new(3);
        drop(tickets.pop());
        let waiting: Vec<_> = tickets
            .into_iter()
            .map(|t| std::thread::spawn(move || t.wait()))
            .collect();
        assert!(go.wait_ready(3, std::time::Duration::from_secs(10)));
        assert!(!go.wait_ready(4, std::time::Duration::from_millis(10)));
        go.give(true);
        go.give(false);
        for w in waiting {
            assert!(w.join().unwrap());
        }
        let (go, mut tickets) = Go::new(1);
        go.give(false);
        assert!(!tickets.pop().unwrap().wait());
        assert!(Ticket::free().wait());
    }

    /// Values are made, used and dropped on their own thread; many at once.
    #[test]
    fn values_stay_on_their_thread() {
        struct Mine(std::thread::ThreadId, Arc<Mutex<Vec<bool>>>);
        impl Drop for Mine {
            fn drop(&mut self) {
                let same = std::thread::current().id() == self.0;
                self.1.lock().unwrap().push(same);
            }
        }
        let drops = Arc::new(Mutex::new(Vec::new()));
        let started: Vec<_> = (0..8)
            .map(|i| {
                let d = drops.clone();
                Tracer::start(format!("t{i}"), move || {
                    Ok::<_, ()>(Mine(std::thread::current().id(), d))
                })
                .unwrap()
            })
            .collect();
        let tracers: Vec<Tracer<Mine>> = started
            .into_iter()
            .map(|s| s.join().ok().unwrap())
            .collect();
        let answers: Vec<_> = tracers
            .iter()
            .map(|t| t.run(|m| std::thread::current().id() == m.0))
            .collect();
        assert!(answers.into_iter().all(|p| p.wait().unwrap()));
        let mut tracers = tracers.into_iter();
        let first = tracers.next().unwrap();
        assert!(first
            .end(|m| std::thread::current().id() == m.0)
            .wait()
            .unwrap());
        end_all(tracers);
        let d = drops.lock().unwrap();
        assert_eq!(d.len(), 8);
        assert!(d.iter().all(|&same| same));
    }

    /// A value that cannot be made is reported, and its thread ends.
    #[test]
    fn make_error_is_reported() {
        let s = Tracer::<()>::start("bad".into(), || Err::<(), _>("no")).unwrap();
        assert!(matches!(s.join(), Err(Ok("no"))));
    }

    /// The gate lets at most n in at once.
    #[test]
    fn gate_bounds() {
        let g = Arc::new(Gate::new(2));
        let inside = Arc::new(Mutex::new((0usize, 0usize)));
        let hs: Vec<_> = (0..6)
            .map(|_| {
                let (g, inside) = (g.clone(), inside.clone());
                std::thread::spawn(move || {
                    let _p = g.enter();
                    {
                        let mut i = inside.lock().unwrap();
                        i.0 += 1;
                        i.1 = i.1.max(i.0);
                    }
                    std::thread::yield_now();
                    inside.lock().unwrap().0 -= 1;
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert!(inside.lock().unwrap().1 <= 2);
    }

    /// Nobody passes the rendezvous before every party arrived or gave
    /// up; a party that gives up (drops its arrival) does not hold the
    /// others.
    #[test]
    fn rendezvous_waits_for_all_or_gives_up() {
        let arrived = Arc::new(Mutex::new(0usize));
        let mut arrivals = Rendezvous::arrivals(4);
        let quitter = arrivals.pop().unwrap();
        let hs: Vec<_> = arrivals
            .into_iter()
            .map(|a| {
                let arrived = arrived.clone();
                std::thread::spawn(move || {
                    *arrived.lock().unwrap() += 1;
                    a.wait();
                    // Everyone else arrived (the quitter gave up) before this.
                    *arrived.lock().unwrap()
                })
            })
            .collect();
        // The three wait for the fourth until it gives up.
        let t = std::time::Instant::now();
        while *arrived.lock().unwrap() < 3 {
            assert!(t.elapsed() < std::time::Duration::from_secs(10));
            std::thread::yield_now();
        }
        assert!(hs.iter().all(|h| !h.is_finished()));
        drop(quitter);
        for h in hs {
            assert_eq!(h.join().unwrap(), 3);
        }
    }
}
