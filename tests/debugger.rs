//! A debugger on a backend of the test cluster, for the interleavings no SQL can set up: a
//! backend stopped at a point inside Postgres while others go on. It runs Debian's `gdb` (which
//! `scripts/rig` installs) on the server's own binary: breakpoints are on functions it exports,
//! with conditions on their arguments' registers (x86-64: the first is `$rdi`) or on what other
//! exported functions return (called with a cast: `(unsigned int) GetTopTransactionIdIfAny()`),
//! so they need no debug symbols. The tests run as root beside the cluster, so gdb may attach to its backends.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

/// How long anything here may take before the test gives up: the steps are quick, and a backend
/// left stopped would hold the cluster's shutdown up.
const PATIENCE: Duration = Duration::from_secs(120);

/// gdb attached to one backend, with one breakpoint. Dropped, it lets the backend go on.
pub struct Debugger {
    gdb: Child,
    /// Closed, it ends gdb, which then takes its breakpoint out and lets the backend go.
    input: Option<ChildStdin>,
    lines: Receiver<String>,
    output: Vec<String>,
    stopped: bool,
    detached: bool,
}

impl Debugger {
    /// Attaches to backend `pid`, stops it at `function` whenever `condition` holds, and lets it
    /// run on. Returns once the breakpoint is in place.
    pub fn attach(pid: i32, function: &str, condition: &str) -> Debugger {
        let mut gdb = Command::new("gdb")
            .args(["-q", "-nx", "-p", &pid.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("run gdb (Debian's gdb package; scripts/rig installs it)");
        let input = gdb.stdin.take().expect("gdb's stdin");
        let stdout = gdb.stdout.take().expect("gdb's stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut debugger =
            Debugger { gdb, input: Some(input), lines, output: Vec::new(), stopped: false, detached: false };
        // Postgres' own signals (latches, interrupts, timeouts) pass through; gdb's interrupt
        // (SIGINT) stops the backend and is not delivered to it.
        for command in [
            "set pagination off",
            "set confirm off",
            "handle all nostop noprint pass",
            "handle SIGINT stop print nopass",
            // At the function's first instruction, where the arguments are in their registers
            // (with debug symbols installed gdb would otherwise stop after the prologue).
            &format!("break *{function} if {condition}"),
            "continue &",
        ] {
            debugger.send(command);
        }
        debugger.expect("Continuing.");
        debugger
    }

    /// Sends a command; a gdb that ended shows in what is expected of it next.
    fn send(&mut self, command: &str) {
        if let Some(input) = self.input.as_mut() {
            let _ = writeln!(input, "{command}").and_then(|_| input.flush());
        }
    }

    /// Reads gdb's output until a line contains `what`.
    fn expect(&mut self, what: &str) {
        if let Err(e) = self.try_expect(what) {
            panic!("{e}");
        }
    }

    fn try_expect(&mut self, what: &str) -> Result<(), String> {
        let deadline = Instant::now() + PATIENCE;
        while !self.poll(what)? {
            if Instant::now() >= deadline {
                return Err(format!("gdb never printed {what:?}; it printed:\n{}", self.output.join("\n")));
            }
        }
        Ok(())
    }

    /// Reads what gdb printed meanwhile (a short wait for more); whether a line had `what`.
    fn poll(&mut self, what: &str) -> Result<bool, String> {
        match self.lines.recv_timeout(Duration::from_millis(20)) {
            Ok(line) => {
                let found = line.contains(what);
                let refused = ["ptrace: Operation not permitted", "Could not attach", "No such process"]
                    .iter()
                    .any(|e| line.contains(e));
                self.output.push(line);
                if refused {
                    return Err(format!(
                        "gdb cannot attach to the backend (the tests run as root beside the cluster): {}",
                        self.output.join("\n")
                    ));
                }
                // gdb stops wherever it cannot evaluate a condition: that is no stop of the test's.
                if self.output.last().is_some_and(|l| l.contains("Error in testing")) {
                    return Err(format!("gdb cannot evaluate the breakpoint's condition: {}", self.output.join("\n")));
                }
                Ok(found)
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Ok(false),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(format!("gdb ended; it printed:\n{}", self.output.join("\n")))
            }
        }
    }

    /// Waits until the backend stops at the breakpoint (true), or until `gone_past` says it
    /// never will (false): the call that would have reached it has returned.
    pub fn wait_for_stop(&mut self, mut gone_past: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if self.poll("Breakpoint 1,").unwrap_or_else(|e| panic!("{e}")) {
                self.stopped = true;
                return true;
            }
            if gone_past() {
                return false;
            }
            assert!(
                Instant::now() < deadline,
                "the backend neither stopped nor went past; gdb printed:\n{}",
                self.output.join("\n")
            );
        }
    }

    /// Lets the backend go on without the breakpoint, and ends gdb.
    pub fn detach(mut self) {
        if let Err(e) = self.let_go() {
            panic!("{e}");
        }
    }

    /// gdb takes its breakpoint out of the backend's code only while the backend is stopped, so
    /// it is stopped first (a backend gdb merely died on would trap at the breakpoint and crash).
    fn let_go(&mut self) -> Result<(), String> {
        self.detached = true;
        if !self.stopped {
            self.send("interrupt");
            self.try_expect("SIGINT")?;
        }
        self.send("detach");
        self.try_expect("detached")?;
        self.send("quit");
        let deadline = Instant::now() + PATIENCE;
        while self.gdb.try_wait().ok().flatten().is_none() {
            if Instant::now() >= deadline {
                return Err("gdb did not quit".into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }
}

impl Drop for Debugger {
    fn drop(&mut self) {
        // A test that failed half-way must not leave the backend stopped. Never kill gdb: a
        // backend it leaves running with its breakpoint in place traps on it and dies, and the
        // postmaster then restarts every session. Closing its input ends it the clean way.
        if !self.detached && self.let_go().is_err() {
            self.input = None;
            let _ = self.gdb.wait();
        }
    }
}

/// The backend process of connection `c`.
pub fn backend_pid(c: &mut postgres::Client) -> i32 {
    c.query_one("SELECT pg_backend_pid()", &[]).expect("pg_backend_pid").get(0)
}

/// Waits until backend `pid` waits for a buffer's content lock (true), or `done` says the call
/// returned first (false).
pub fn waits_for_a_buffer(monitor: &mut postgres::Client, pid: i32, done: impl FnMut() -> bool) -> bool {
    waits_for(monitor, pid, "BufferContent", done)
}

/// Waits until backend `pid` waits for a relation's lock (true), or `done` says the call
/// returned first (false).
pub fn waits_for_a_relation(monitor: &mut postgres::Client, pid: i32, done: impl FnMut() -> bool) -> bool {
    waits_for(monitor, pid, "relation", done)
}

/// Waits until backend `pid` shows `wait_event` in pg_stat_activity (true), or `done` says the
/// call returned first (false).
fn waits_for(monitor: &mut postgres::Client, pid: i32, wait_event: &str, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let event: Option<String> = monitor
            .query_one("SELECT wait_event FROM pg_stat_activity WHERE pid = $1", &[&pid])
            .expect("pg_stat_activity")
            .get(0);
        if event.as_deref() == Some(wait_event) {
            return true;
        }
        if done() {
            return false;
        }
        assert!(Instant::now() < deadline, "backend {pid} neither waited for {wait_event} nor returned");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The result of a thread that runs a statement, once it returns: a test that set up a wait
/// wrongly fails here instead of hanging (and its debuggers let their backends go as it unwinds).
pub fn join<T>(thread: std::thread::JoinHandle<T>) -> T {
    let deadline = Instant::now() + PATIENCE;
    while !thread.is_finished() {
        assert!(Instant::now() < deadline, "a statement did not return");
        std::thread::sleep(Duration::from_millis(5));
    }
    thread.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}
