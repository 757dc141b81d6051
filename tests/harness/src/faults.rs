//! Faults injected into real processes: system calls made to fail through strace, a proxy that
//! cuts a connection just as the answer comes back, and a small tmpfs that fills up.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::signal;

/// strace attached to every thread of a process, making some of its system calls fail or wait.
pub struct Strace {
    child: Option<Child>,
    trace: PathBuf,
    stderr: PathBuf,
}

impl Strace {
    /// Makes `syscalls` of `pid` fail with `errno` on the calls `when` selects (strace's syntax:
    /// `7+61` is the 7th call and every 61st after it, counted per thread). Returns once strace
    /// has attached. strace, not a mock: the process really sees the error.
    pub async fn inject(pid: u32, syscalls: &str, errno: &str, when: &str, dir: &Path) -> Self {
        Self::attach(pid, syscalls, &format!("error={errno}:when={when}"), errno, dir).await
    }

    /// Makes every call of `syscalls` of `pid` wait `delay` before it runs (a slow disk, when
    /// they are its fsyncs). Returns once strace has attached.
    pub async fn delay(pid: u32, syscalls: &str, delay: Duration, dir: &Path) -> Self {
        Self::attach(pid, syscalls, &format!("delay_enter={}", delay.as_micros()), "delay", dir).await
    }

    async fn attach(pid: u32, syscalls: &str, injection: &str, label: &str, dir: &Path) -> Self {
        let name = format!("strace-{pid}-{}-{label}", syscalls.replace(',', "+"));
        let trace = dir.join(format!("{name}.trace"));
        let stderr = dir.join(format!("{name}.stderr"));
        let child = Command::new("strace")
            .args(["-f", "-o"])
            .arg(&trace)
            .args(["-e", &format!("trace={syscalls}")])
            .args(["-e", &format!("inject={syscalls}:{injection}")])
            .args(["-p", &pid.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).expect("create the strace log"))
            .spawn()
            .expect("run strace (scripts/install-test-tools installs it)");
        let mut strace = Self { child: Some(child), trace, stderr };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let log = std::fs::read_to_string(&strace.stderr).unwrap_or_default();
            if log.contains("attached") {
                return strace;
            }
            if let Some(status) = strace.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("strace exited with {status} before attaching:\n{log}");
            }
            assert!(Instant::now() < deadline, "strace did not attach within 10 s:\n{log}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Detaches (the process runs on unharmed) and returns how many calls failed or waited by
    /// injection.
    pub async fn stop(mut self) -> usize {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "INT");
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().ok().flatten().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        std::fs::read_to_string(&self.trace)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("(INJECTED)") || l.contains("(DELAYED)"))
            .count()
    }
}

impl Drop for Strace {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A TCP proxy in front of a server. Once told to, it lets the next request through and, when
/// the server starts answering, closes the client's connection instead of passing the answer
/// on: the server did the work, the client never hears of it (a connection killed mid-call).
///
/// It can also hold every byte both ways (a network partition between the two), or only the
/// requests, until healed, or pass every answer on late (a slow way back).
pub struct CuttingProxy {
    pub addr: SocketAddr,
    faults: Faults,
    task: tokio::task::JoinHandle<()>,
}

impl CuttingProxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let addr = listener.local_addr().unwrap();
        let faults = Faults::default();
        let shared = faults.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else { continue };
                tokio::spawn(relay(client, server, shared.clone()));
            }
        });
        Self { addr, faults, task }
    }

    /// From now on every answer byte from the server reaches the client `delay` after it left
    /// the server (in order; requests go through at once), until set back to zero.
    pub fn delay_answers(&self, delay: Duration) {
        self.faults.delay_ms.store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// The next answer bytes from the server (on any connection) kill that connection instead.
    pub fn cut_next_answer(&self) {
        self.faults.cut.store(true, Ordering::SeqCst);
    }

    /// From now on nothing gets through either way (the connections stay open, as in a network
    /// partition), until [`CuttingProxy::heal`].
    pub fn partition(&self) {
        self.faults.held.store(true, Ordering::SeqCst);
    }

    /// From now on no request reaches the server (answers to those already sent still come
    /// back), until [`CuttingProxy::heal`].
    pub fn hold_requests(&self) {
        self.faults.requests_held.store(true, Ordering::SeqCst);
    }

    /// Lets what was held, and everything after it, through again.
    pub fn heal(&self) {
        self.faults.held.store(false, Ordering::SeqCst);
        self.faults.requests_held.store(false, Ordering::SeqCst);
    }
}

impl Drop for CuttingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the proxy does to the bytes it passes, shared by its connections.
#[derive(Clone, Default)]
struct Faults {
    cut: Arc<AtomicBool>,
    /// Both ways (a partition).
    held: Arc<AtomicBool>,
    requests_held: Arc<AtomicBool>,
    /// How long each answer byte is held back, in milliseconds.
    delay_ms: Arc<AtomicU64>,
}

async fn relay(client: TcpStream, server: TcpStream, faults: Faults) {
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let (held, requests_held) = (Arc::clone(&faults.held), faults.requests_held);
    let requests_held = move || held.load(Ordering::SeqCst) || requests_held.load(Ordering::SeqCst);
    let upstream = tokio::spawn(pump(client_read, server_write, None, requests_held, None));
    let held = faults.held;
    let answers_held = move || held.load(Ordering::SeqCst);
    pump(server_read, client_write, Some(faults.cut), answers_held, Some(faults.delay_ms)).await;
    upstream.abort();
}

/// Passes bytes one way, holding them while `held`, each chunk no sooner than `delay` (ms)
/// after it was read; with `cut`, the next answer set to be cut is dropped with the connection.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    cut: Option<Arc<AtomicBool>>,
    held: impl Fn() -> bool,
    delay: Option<Arc<AtomicU64>>,
) {
    // Reading goes on while a chunk waits out its delay, so later chunks are not delayed twice.
    // The reader stops with the pump (the set aborts it when dropped, also when the pump is).
    let (chunks, mut queue) = tokio::sync::mpsc::unbounded_channel();
    let mut reader = tokio::task::JoinSet::new();
    reader.spawn(async move {
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let delay = delay.as_ref().map_or(0, |d| d.load(Ordering::SeqCst));
            let due = (delay > 0).then(|| tokio::time::Instant::now() + Duration::from_millis(delay));
            if chunks.send((due, buffer[..n].to_vec())).is_err() {
                break;
            }
        }
    });
    while let Some((due, chunk)) = queue.recv().await {
        if let Some(due) = due {
            tokio::time::sleep_until(due).await;
        }
        while held() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if cut.as_ref().is_some_and(|cut| cut.swap(false, Ordering::SeqCst)) {
            // Drop the answer and the connection.
            break;
        }
        if to.write_all(&chunk).await.is_err() {
            break;
        }
    }
}

/// A tmpfs of a fixed size, mounted for one test (the tests run as root) and unmounted after.
pub struct Tmpfs {
    pub path: PathBuf,
}

impl Tmpfs {
    pub fn mount(path: &Path, size: &str) -> Self {
        std::fs::create_dir_all(path).expect("create the tmpfs mount point");
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(path)
            .status()
            .expect("run mount");
        assert!(status.success(), "mounting a {size} tmpfs on {} failed (the tests need root)", path.display());
        Self { path: path.to_owned() }
    }

    /// Fills the file system with a ballast file until a write fails (the disk is full).
    pub fn fill(&self) -> PathBuf {
        let ballast = self.path.join("ballast");
        let mut file = std::fs::File::create(&ballast).expect("create the ballast");
        let block = vec![0u8; 64 * 1024];
        while std::io::Write::write_all(&mut file, &block).is_ok() {}
        let _ = file.sync_all();
        ballast
    }

    /// Frees `bytes` of the space `fill` took.
    pub fn free(&self, bytes: u64) {
        let ballast =
            std::fs::OpenOptions::new().write(true).open(self.path.join("ballast")).expect("open the ballast");
        let len = ballast.metadata().expect("the ballast's size").len();
        ballast.set_len(len.saturating_sub(bytes)).expect("shrink the ballast");
    }

    /// Frees the space `fill` took.
    pub fn drain(&self) {
        let _ = std::fs::remove_file(self.path.join("ballast"));
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}
