//! Files a process keeps locked while it runs, so that two live processes cannot take one role
//! that must have a single holder: the writer of a database, or an instance name (a process
//! starting under a name takes back every claim of that name's earlier runs, which is only sound
//! if none of them is alive).
//!
//! The locks are `flock`s on small files. The kernel lets go of them when the process exits,
//! however it exits (a SIGKILL too), so a lock that is held always means a live holder. They
//! see processes on one machine only (files on one filesystem); across machines the names stay
//! the operator's to keep apart (a pod name).

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use reelay_domain::MAX_INSTANCE_BYTES;

/// A lock this process holds; let go when dropped or when the process ends.
#[derive(Debug)]
pub struct Held(#[allow(dead_code, reason = "held for its lock")] File);

/// Who holds a lock that could not be taken, as its holder wrote it on the file's first line.
fn holder(path: &Path) -> String {
    let mut text = String::new();
    let read = File::open(path).and_then(|mut f| f.read_to_string(&mut text));
    let line = read.ok().and_then(|_| text.lines().next().map(|l| l.trim().to_owned())).filter(|t| !t.is_empty());
    let Some(line) = line else {
        return "a process that has not said who it is".into();
    };
    // A holder running as this process's user could not rewrite another user's file (it locks
    // it opened for reading): the line may be an earlier run's.
    match OpenOptions::new().append(true).open(path) {
        Err(error) if error.kind() == io::ErrorKind::PermissionDenied => format!(
            "{line} as the lock file says, if that run still holds it: the file is another user's, which a holder \
             running as this user could not rewrite"
        ),
        _ => line,
    }
}

/// Takes the lock at `path` if no live process holds it, and writes this process's pid and
/// `what` it holds the lock as into it, for whoever finds it taken. `None`: a live process
/// holds it.
fn try_take(path: &Path, what: &str) -> io::Result<Option<Held>> {
    let (mut file, writable) = match OpenOptions::new().create(true).truncate(false).read(true).write(true).open(path) {
        Ok(file) => (file, true),
        // Another user's lock file (a process run as someone else), or one on a filesystem
        // mounted read-only since: a lock is taken on a file opened for reading as well, it
        // just cannot say who holds it.
        // (No file, and none can be made: the open's own error says so, not the NotFound of
        // opening a file that is not there; the callers name the dir and its setting.)
        Err(error) if cannot_write(&error) && path.try_exists().unwrap_or(false) => (File::open(path)?, false),
        Err(error) => return Err(error),
    };
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => return Ok(None),
        Err(TryLockError::Error(error)) => return Err(error),
    }
    if writable {
        file.set_len(0)?;
        file.rewind()?;
        writeln!(file, "pid {}\n{what}", std::process::id())?;
    }
    Ok(Some(Held(file)))
}

fn cannot_write(error: &io::Error) -> bool {
    matches!(error.kind(), io::ErrorKind::PermissionDenied | io::ErrorKind::ReadOnlyFilesystem)
}

/// How long a lock that is held is asked for again before giving up: a process restarted the
/// moment its predecessor was told to stop may start while the predecessor is still exiting.
const PATIENCE: Duration = Duration::from_secs(5);

/// Takes the lock at `path`, waiting up to [`PATIENCE`] for a live holder to let go.
async fn take_waiting(path: &Path, what: &str) -> anyhow::Result<Result<Held, String>> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let mut said = false;
    loop {
        if let Some(held) = try_take(path, what).with_context(|| format!("cannot lock {}", path.display()))? {
            return Ok(Ok(held));
        }
        let holder = holder(path);
        if tokio::time::Instant::now() >= deadline {
            return Ok(Err(holder));
        }
        if !said {
            tracing::warn!(lock = %path.display(), %holder, "held by another process ({what}); waiting for it to let go");
            said = true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One write service per database: the write service keeps state of its own beside the file
/// (which claims wait, which leases it holds back), and two of them would each hand out work
/// the other does not know of. Refused with the holder named.
pub async fn database_writer(database: &Path) -> anyhow::Result<Held> {
    let dir = database.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // One lock however the database is named (a relative path, a symlinked dir).
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    let mut name = database.file_name().unwrap_or_default().to_owned();
    name.push(".writer.lock");
    let path = dir.join(name);
    let taken = take_waiting(&path, &format!("the write service of {}", database.display())).await.map_err(
        |error| match error.root_cause().downcast_ref::<io::Error>() {
            Some(io) if cannot_write(io) => error.context(format!(
                "the write service cannot lock its database (with a file beside it): make {} writable by this \
                 user, or set REELAY_DATA_DIR (or REELAY_DATABASE) to a directory it can write",
                dir.display()
            )),
            _ => error,
        },
    )?;
    match taken {
        Ok(held) => Ok(held),
        Err(holder) => bail!(
            "the database {} is in use by another write service ({holder}); a database has one write service: \
             stop that one, or give this one another REELAY_DATABASE",
            database.display()
        ),
    }
}

/// The file whose lock stands for the instance name `name` in `dir`. Names may hold any
/// character (a path, a host name), so the file is named by a hash of the name.
fn instance_lock_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!(".instance-{:016x}.lock", fnv1a(name)))
}

/// How many live processes may share a data dir under the default instance name.
const MAX_SLOTS: u32 = 64;

/// The default instance name of the `slot`th live process in the data dir `dir` on `host`:
/// `host:dir` for the first, `host/2:dir` and so on for the others. A host name holds no `/`,
/// so no other data dir's name can be one of these. `dir` is named by its full path when it
/// exists, and `#` (which ends the instance in an owner) is left out of the name. A name longer
/// than [`MAX_INSTANCE_BYTES`] (a deep dir) keeps the dir's last part and a hash of its whole
/// path instead: `host:…/data~<hash>`.
pub fn default_name(host: &str, dir: &Path, slot: u32) -> String {
    slot_name(host, &full_path(dir), slot)
}

fn full_path(dir: &Path) -> PathBuf {
    std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned())
}

/// [`default_name`] of a dir already named by its full path.
fn slot_name(host: &str, dir: &Path, slot: u32) -> String {
    let prefix = if slot == 1 { host.to_owned() } else { format!("{host}/{slot}") };
    let name = format!("{prefix}:{}", dir.display()).replace('#', "_");
    if name.len() <= MAX_INSTANCE_BYTES {
        return name;
    }
    let last = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let (prefix, last) = (up_to_bytes(&prefix, 80), up_to_bytes(&last, 40));
    format!("{prefix}:…/{last}~{:016x}", fnv1a(&dir.display().to_string())).replace('#', "_")
}

/// The longest start of `text` of at most `bytes` bytes that ends on a character's boundary.
fn up_to_bytes(text: &str, bytes: usize) -> &str {
    &text[..text.floor_char_boundary(bytes)]
}

/// FNV-1a of `text`: stable across builds and processes, which std's hasher does not promise.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// This process's instance name, and the lock that keeps it its own among the live processes
/// that keep their locks in `data_dir` (made here if it is missing, so the name holds the dir's
/// full path from the first run on).
///
/// An explicit name (`REELAY_INSTANCE`, `#` already left out) held by a live process is refused
/// (after waiting a little for it to exit): its claims would be taken back by this one.
/// Without one, the name is the first [`default_name`] no live process holds, so replicas
/// started side by side in one dir each get a name of their own, and a restarted one takes the
/// name (and the claims) of a dead one, never of a live one.
///
/// When the dir cannot hold a lock (read-only, a filesystem without `flock`), the name is used
/// unchecked, as before there were locks, and a warning says so.
pub async fn instance(explicit: Option<&str>, host: &str, data_dir: &Path) -> anyhow::Result<(String, Option<Held>)> {
    if let Some(name) = explicit
        && (name.is_empty() || name.len() > MAX_INSTANCE_BYTES)
    {
        bail!(
            "REELAY_INSTANCE must be 1 to {MAX_INSTANCE_BYTES} bytes, got {} (leave it unset for the default name, \
             made from the host and the data dir)",
            name.len()
        );
    }
    if let Err(error) = std::fs::create_dir_all(data_dir) {
        let name = explicit.map_or_else(|| default_name(host, data_dir, 1), str::to_owned);
        return Ok(unchecked(&name, data_dir, &error));
    }
    if let Some(name) = explicit {
        let path = instance_lock_path(data_dir, name);
        return match take_waiting(&path, &format!("instance {name}")).await {
            Ok(Ok(held)) => Ok((name.to_owned(), Some(held))),
            Ok(Err(holder)) => bail!(
                "the instance name {name:?} (REELAY_INSTANCE) is in use by a live process on this machine ({holder}); \
                 every live process needs a name of its own, or it would take back the other's claims"
            ),
            Err(error) => Ok(unchecked(name, data_dir, &format!("{error:#}"))),
        };
    }
    let full = full_path(data_dir);
    for slot in 1..=MAX_SLOTS {
        let name = slot_name(host, &full, slot);
        match try_take(&instance_lock_path(data_dir, &name), &format!("instance {name}")) {
            Ok(Some(held)) => {
                if slot > 1 {
                    tracing::info!(instance = %name, data_dir = %data_dir.display(),
                        "other live processes use this data dir; this one runs under a name of its own");
                }
                return Ok((name, Some(held)));
            }
            Ok(None) => continue,
            Err(error) => return Ok(unchecked(&name, data_dir, &error)),
        }
    }
    bail!(
        "{MAX_SLOTS} live processes already use the data dir {}; give this one a REELAY_DATA_DIR or a \
         REELAY_INSTANCE of its own",
        data_dir.display()
    )
}

fn unchecked(name: &str, dir: &Path, error: &dyn std::fmt::Display) -> (String, Option<Held>) {
    tracing::warn!(instance = %name, data_dir = %dir.display(), %error,
        "cannot lock the instance name in the data dir (REELAY_DATA_DIR), so it is not checked against the other \
         live processes here: make sure no other live process runs under it, or give this process a data dir it \
         can write");
    (name.to_owned(), None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An instance name stays short enough for a claimer's name (the write service refuses a
    /// longer one, so a process under it would deliver nothing): a deep data dir's default name
    /// is shortened, and an explicit name too long or empty is refused at start.
    #[tokio::test]
    async fn instance_names_fit_a_claimer_name() {
        let deep = |leaf: &str| PathBuf::from(format!("/{}/{leaf}", "nested/".repeat(30)));
        let (a, b) = (default_name("host", &deep("data"), 1), default_name("host", &deep("other"), 2));
        assert!(a.len() <= MAX_INSTANCE_BYTES && a.starts_with("host:…/data~"), "{a}");
        assert!(b.len() <= MAX_INSTANCE_BYTES && b.starts_with("host/2:…/other~"), "{b}");
        let c = default_name("host", &PathBuf::from(format!("/x{}", deep("data").display())), 1);
        assert_ne!(a, c, "another dir, another name");
        assert!(default_name(&"h".repeat(255), &deep("data"), 64).len() <= MAX_INSTANCE_BYTES);
        let wide = default_name(&"é".repeat(100), &deep(&"映".repeat(60)), 64);
        assert!(wide.len() <= MAX_INSTANCE_BYTES && wide.contains("…/映"), "cut in bytes, on characters: {wide}");
        let dir = tempfile::tempdir().unwrap();
        for name in [String::new(), "n".repeat(MAX_INSTANCE_BYTES + 1)] {
            let error = instance(Some(&name), "host", dir.path()).await.unwrap_err().to_string();
            assert!(error.starts_with("REELAY_INSTANCE must be 1 to 160 bytes"), "{error}");
        }
        assert!(instance(Some(&"n".repeat(MAX_INSTANCE_BYTES)), "host", dir.path()).await.is_ok());
    }

    #[tokio::test]
    async fn a_default_name_taken_by_a_live_process_moves_to_the_next_free_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = std::fs::canonicalize(dir.path()).unwrap();
        let name = |slot: u32| default_name("host", dir.path(), slot);
        assert_eq!((name(1), name(2)), (format!("host:{}", path.display()), format!("host/2:{}", path.display())));
        let (first, first_lock) = instance(None, "host", dir.path()).await.unwrap();
        let (second, _second_lock) = instance(None, "host", dir.path()).await.unwrap();
        assert_eq!((first, second.clone()), (name(1), name(2)));
        // The first one gone, its name is free again; the second keeps its own.
        drop(first_lock);
        let (third, _third_lock) = instance(None, "host", dir.path()).await.unwrap();
        assert_eq!(third, name(1));
        let says = std::fs::read_to_string(instance_lock_path(dir.path(), &second)).unwrap();
        assert!(says.contains(&second) && says.contains(&format!("pid {}", std::process::id())), "{says}");
        // A lock file someone else holds (here another open file of this process) is skipped.
        let holder = File::create(instance_lock_path(dir.path(), &name(3))).unwrap();
        holder.lock().unwrap();
        let (fourth, _fourth_lock) = instance(None, "host", dir.path()).await.unwrap();
        assert_eq!(fourth, name(4));
    }

    #[tokio::test(start_paused = true)]
    async fn an_explicit_name_taken_by_a_live_process_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let (_, _held) = instance(Some("pod-1"), "host", dir.path()).await.unwrap();
        let error = instance(Some("pod-1"), "host", dir.path()).await.unwrap_err().to_string();
        assert!(error.contains("\"pod-1\"") && error.contains(&format!("pid {}", std::process::id())), "{error}");
        let (other, _) = instance(Some("pod-2"), "host", dir.path()).await.unwrap();
        assert_eq!(other, "pod-2");
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_writer_of_a_database_is_refused_and_a_released_one_is_taken() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("sub").join("reelay.db");
        let held = database_writer(&db).await.unwrap();
        let error = database_writer(&db).await.unwrap_err().to_string();
        assert!(error.contains("in use by another write service") && error.contains("reelay.db"), "{error}");
        drop(held);
        database_writer(&db).await.unwrap();
    }
}
