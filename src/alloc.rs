//! The process's memory allocators: jemalloc for Rust's allocations, and the
//! C library's malloc (which C code linked in, such as SQLite and zstd, keeps
//! using) held to few arenas. `MSSQL_CDC_ALLOCATOR=system` puts Rust's
//! allocations on the C library's malloc too.
//!
//! Why: a chunked snapshot reads its chunks on many threads (tokio's blocking
//! pool grows to dozens while queries wait on the link), and glibc gives each
//! thread that meets contention an arena of its own, up to eight per core,
//! whose freed pages it keeps. The peak resident set then grows with the
//! number of chunks read rather than with the size of one chunk, and the only
//! cure used to be an environment variable (`MALLOC_ARENA_MAX=2`) every user
//! had to know. Measured on a 2-core machine (one run each, beside another
//! load), `bench snapshot`'s chunked run, 12,500-row chunks, 17 chunks
//! against 171, peak resident set:
//!
//! | allocator                              | 1x     | 10x    | 10x/1x |
//! |----------------------------------------|--------|--------|--------|
//! | glibc as shipped                       | 227 MB | 564 MB | 2.5    |
//! | glibc, 2 arenas                        | 191 MB | 258 MB | 1.35   |
//! | glibc, 1 arena                         | 189 MB | 199 MB | 1.05   |
//! | mimalloc 3 (glibc as shipped for C)    | 373 MB | 798 MB | 2.1    |
//! | jemalloc 5.3 (glibc as shipped for C)  | 224 MB | 440 MB | 2.0    |
//! | jemalloc 5.3, glibc 1 arena for C      | 215 MB | 248 MB | 1.15   |
//!
//! (Runs vary by about a tenth: `bench snapshot`'s own run of the default
//! gave 224 MB and 263 MB, 1.18x, and of glibc as shipped 231 MB and 520 MB.)
//!
//! A single glibc arena serialises every thread's malloc: `bench apply`
//! (2 M rows, 200,000 changes, a MERGE on all cores) took 2.51 s with one arena
//! against 1.75 s with two, and 1.52 s on jemalloc. So Rust's allocations go to
//! jemalloc, which scales across threads and returns memory on its own, and
//! glibc, left to the C code, gets one arena. `mssql-cdc bench snapshot`
//! measures the default against glibc as shipped in one run, so the choice
//! stays checked rather than assumed.
//!
//! The C library's arena limit is set only when `MALLOC_ARENA_MAX` is not in
//! the environment: an operator's own setting wins. Under
//! `MSSQL_CDC_ALLOCATOR=system` the limit is two arenas, not one, because
//! then every allocation of every thread goes through them.
//!
//! Architecture invariant: the choice is made once, at the first allocation
//! (before `main`, on the only thread there is), and never changes, so every
//! block is freed by the allocator that gave it. The environment is read with
//! `getenv`, which does not allocate; reading it through `std::env` would
//! allocate from inside the allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::CStr;
use std::sync::atomic::{AtomicU8, Ordering};

use tikv_jemallocator::Jemalloc;

/// The environment variable that picks the allocator.
pub const ALLOCATOR_VAR: &str = "MSSQL_CDC_ALLOCATOR";
const ALLOCATOR_VAR_C: &CStr = c"MSSQL_CDC_ALLOCATOR";
/// glibc's own variable for its arena limit; when set, it is left alone.
pub const ARENA_VAR: &str = "MALLOC_ARENA_MAX";
const ARENA_VAR_C: &CStr = c"MALLOC_ARENA_MAX";

const UNDECIDED: u8 = 0;
const JEMALLOC: u8 = 1;
const SYSTEM: u8 = 2;

static CHOICE: AtomicU8 = AtomicU8::new(UNDECIDED);

/// The global allocator `main` installs (`#[global_allocator]`).
pub struct Allocator;

/// What `MSSQL_CDC_ALLOCATOR` asks for; `None` for a value this program
/// does not know (jemalloc is used, and the CLI refuses to run: [`check_env`]).
fn parse(value: Option<&[u8]>) -> Option<u8> {
    match value {
        None | Some(b"") | Some(b"jemalloc") => Some(JEMALLOC),
        Some(b"system") => Some(SYSTEM),
        Some(_) => None,
    }
}

/// The C library's arena limit for a choice: one arena when only C code
/// allocates from it, two when Rust's allocations share it.
fn arena_limit(choice: u8) -> i32 {
    if choice == SYSTEM {
        2
    } else {
        1
    }
}

/// `getenv` as bytes. SAFETY (for callers): no thread may be changing the
/// environment; it is only called at the first allocation, before `main`.
unsafe fn getenv_bytes(name: &CStr) -> Option<&'static [u8]> {
    // SAFETY: getenv returns NULL or a NUL-terminated string owned by the
    // environment, which nothing here modifies.
    let raw = unsafe { libc::getenv(name.as_ptr()) };
    (!raw.is_null()).then(|| unsafe { CStr::from_ptr(raw) }.to_bytes())
}

#[cold]
fn decide() -> u8 {
    // SAFETY: the first allocation happens before `main`, on the only thread;
    // two racing first calls would read the same, unchanged environment.
    let c = parse(unsafe { getenv_bytes(ALLOCATOR_VAR_C) }).unwrap_or(JEMALLOC);
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if unsafe { getenv_bytes(ARENA_VAR_C) }.is_none() {
            // SAFETY: mallopt only sets a limit glibc reads when it next
            // creates an arena; it does not allocate through this allocator.
            unsafe { libc::mallopt(libc::M_ARENA_MAX, arena_limit(c)) };
        }
    }
    CHOICE.store(c, Ordering::Relaxed);
    c
}

#[inline]
fn choice() -> u8 {
    match CHOICE.load(Ordering::Relaxed) {
        UNDECIDED => decide(),
        c => c,
    }
}

// SAFETY: each method forwards to one allocator, the same one for the whole
// life of the process (see the module's invariant), so a block is always
// freed or resized by the allocator that made it.
unsafe impl GlobalAlloc for Allocator {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match choice() {
            SYSTEM => unsafe { System.alloc(layout) },
            _ => unsafe { Jemalloc.alloc(layout) },
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match choice() {
            SYSTEM => unsafe { System.alloc_zeroed(layout) },
            _ => unsafe { Jemalloc.alloc_zeroed(layout) },
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        match choice() {
            SYSTEM => unsafe { System.dealloc(ptr, layout) },
            _ => unsafe { Jemalloc.dealloc(ptr, layout) },
        }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        match choice() {
            SYSTEM => unsafe { System.realloc(ptr, layout, new_size) },
            _ => unsafe { Jemalloc.realloc(ptr, layout, new_size) },
        }
    }
}

/// The allocator this process runs on: `jemalloc`, `system`, or
/// `system (not installed)` when [`Allocator`] never ran (a test binary,
/// which keeps Rust's default).
pub fn name() -> &'static str {
    match CHOICE.load(Ordering::Relaxed) {
        JEMALLOC => "jemalloc",
        SYSTEM => "system",
        _ => "system (not installed)",
    }
}

/// The C library's arena limit in force: the operator's `MALLOC_ARENA_MAX`,
/// else the one set at start, else `None` ([`Allocator`] not installed, or
/// not glibc).
pub fn c_arena_limit() -> Option<String> {
    if let Some(v) = std::env::var_os(ARENA_VAR) {
        return Some(v.to_string_lossy().into_owned());
    }
    match CHOICE.load(Ordering::Relaxed) {
        UNDECIDED => None,
        c if cfg!(all(target_os = "linux", target_env = "gnu")) => Some(arena_limit(c).to_string()),
        _ => None,
    }
}

/// Refuses a `MSSQL_CDC_ALLOCATOR` this program does not know, so a typo
/// (`glibc`, `System`) is an error naming the fix rather than a silent
/// default.
pub fn check_env() -> Result<(), String> {
    let value = std::env::var_os(ALLOCATOR_VAR);
    match parse(value.as_ref().map(|v| v.as_encoded_bytes())) {
        Some(_) => Ok(()),
        None => Err(format!(
            "{ALLOCATOR_VAR}={:?} is not an allocator this program knows: set it to `system` \
             (the C library's malloc) or `jemalloc` (the default), or unset it",
            value.unwrap_or_default()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_picks_the_allocator_and_refuses_what_it_does_not_know() {
        assert_eq!(parse(None), Some(JEMALLOC));
        assert_eq!(parse(Some(b"")), Some(JEMALLOC));
        assert_eq!(parse(Some(b"jemalloc")), Some(JEMALLOC));
        assert_eq!(parse(Some(b"system")), Some(SYSTEM));
        assert_eq!(parse(Some(b"glibc")), None);
        assert_eq!(parse(Some(b"mimalloc")), None);
        assert_eq!(parse(Some(b"System")), None);
        // One arena when only C code uses glibc; two when everything does.
        assert_eq!((arena_limit(JEMALLOC), arena_limit(SYSTEM)), (1, 2));
    }
}
