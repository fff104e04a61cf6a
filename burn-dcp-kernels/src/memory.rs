//! Memory per rank when ranks are threads of one process: an accounting global allocator.
//!
//! A process's resident memory is every rank's together when its ranks are threads, so per-rank
//! memory needs its own accounting. [`TrackingAllocator`] wraps the system allocator and charges
//! every allocation to the *tag* of the thread that makes it (a rank index; the in-process world
//! tags its rank threads, and the portable kernels' pool workers take the tag of the rank they
//! work for), until it is freed — on whatever thread frees it (a message's buffer stays charged to
//! its sender until its receiver drops it). [`peak_bytes`] is a tag's high-water mark of live
//! bytes since the process started (or [`reset_peak`]). It counts only while a binary installs
//! it:
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOCATOR: burn_dcp_kernels::memory::TrackingAllocator =
//!     burn_dcp_kernels::memory::TrackingAllocator;
//! ```
//!
//! Allocations of untagged threads (a planning thread, the main thread) are not charged to any
//! rank. Each allocation carries a header of at least 16 bytes (its alignment) with its tag and
//! size; the accounting counts the requested size.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

/// Tags (ranks) with their own counters; higher tags are not charged.
pub const MAX_TAGS: usize = 1024;

const NO_TAG: usize = usize::MAX;

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicI64 = AtomicI64::new(0);
static LIVE: [AtomicI64; MAX_TAGS] = [ZERO; MAX_TAGS];
static PEAK: [AtomicI64; MAX_TAGS] = [ZERO; MAX_TAGS];
static INSTALLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    static TAG: Cell<usize> = const { Cell::new(NO_TAG) };
}

/// The tag of this thread (`None`: untagged).
pub fn tag() -> Option<usize> {
    let tag = TAG.try_with(Cell::get).unwrap_or(NO_TAG);
    (tag != NO_TAG).then_some(tag)
}

/// Tags this thread with `tag` while the guard lives (the previous tag comes back after).
#[must_use = "the tag holds only while the guard lives"]
pub struct TagGuard {
    previous: usize,
}

impl TagGuard {
    pub fn set(tag: Option<usize>) -> Self {
        let previous = TAG.with(|t| t.replace(tag.unwrap_or(NO_TAG)));
        Self { previous }
    }
}

impl Drop for TagGuard {
    fn drop(&mut self) {
        let previous = self.previous;
        let _ = TAG.try_with(|t| t.set(previous));
    }
}

/// Whether a [`TrackingAllocator`] is the global allocator and has allocated.
pub fn installed() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// The most bytes live at once that were allocated under `tag`, since the start or the last
/// [`reset_peak`]; `None` when no [`TrackingAllocator`] is installed or `tag` has no counter.
pub fn peak_bytes(tag: usize) -> Option<u64> {
    (installed() && tag < MAX_TAGS).then(|| PEAK[tag].load(Ordering::Relaxed).max(0) as u64)
}

/// Bytes allocated under `tag` that are live now (see [`peak_bytes`]).
pub fn live_bytes(tag: usize) -> Option<u64> {
    (installed() && tag < MAX_TAGS).then(|| LIVE[tag].load(Ordering::Relaxed).max(0) as u64)
}

/// Starts `tag`'s high-water mark again from its live bytes.
pub fn reset_peak(tag: usize) {
    if tag < MAX_TAGS {
        PEAK[tag].store(LIVE[tag].load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// This process's peak resident memory (`VmHWM` of `/proc/self/status`, Linux), in bytes;
/// `None` where it cannot be read.
pub fn process_peak_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    let kib: u64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

fn charge(tag: usize, bytes: i64) {
    if tag < MAX_TAGS {
        let live = LIVE[tag].fetch_add(bytes, Ordering::Relaxed) + bytes;
        if bytes > 0 {
            PEAK[tag].fetch_max(live, Ordering::Relaxed);
        }
    }
}

/// The system allocator, charging each allocation to its thread's tag (see the module docs).
pub struct TrackingAllocator;

/// The header before each allocation: its offset (the alignment, at least 16) and the layout of
/// the whole block.
fn whole(layout: Layout) -> Option<(usize, Layout)> {
    let offset = layout.align().max(16);
    let size = layout.size().checked_add(offset)?;
    Some((offset, Layout::from_size_align(size, offset).ok()?))
}

/// Writes the header (tag, requested size) just before `user`.
///
/// # Safety
/// `user` is `offset ≥ 16` bytes into a live block of this allocator, aligned to 16.
unsafe fn write_header(user: *mut u8, tag: usize, size: usize) {
    // SAFETY: the 16 bytes before `user` lie in the block's header (the caller's contract), and
    // they are aligned for two `usize`s (the block's alignment is at least 16).
    unsafe {
        let header = user.sub(16) as *mut usize;
        header.write(tag);
        header.add(1).write(size);
    }
}

/// The header (tag, requested size) that [`write_header`] wrote before `user`.
///
/// # Safety
/// `user` was returned by this allocator and not freed.
unsafe fn read_header(user: *mut u8) -> (usize, usize) {
    // SAFETY: every pointer this allocator returns has its header written just before it.
    unsafe {
        let header = user.sub(16) as *const usize;
        (header.read(), header.add(1).read())
    }
}

// SAFETY: every block comes from `System` with the layout `whole` gives, which the matching
// `dealloc`/`realloc` recompute from the caller's layout; the pointers returned are `offset`
// bytes into it, aligned to the caller's alignment (the offset is a multiple of it).
unsafe impl GlobalAlloc for TrackingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: `GlobalAlloc::alloc`'s contract is `allocate`'s.
        unsafe { self.allocate(layout, false) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        unsafe { self.allocate(layout, true) }
    }

    unsafe fn dealloc(&self, user: *mut u8, layout: Layout) {
        let Some((offset, block)) = whole(layout) else {
            return;
        };
        // SAFETY: `user` came from this allocator with `layout` (GlobalAlloc's contract), so its
        // block starts `offset` bytes before it and has the layout `block`.
        unsafe {
            let (tag, size) = read_header(user);
            charge(tag, -(size as i64));
            System.dealloc(user.sub(offset), block);
        }
    }

    unsafe fn realloc(&self, user: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let Some((offset, block)) = whole(layout) else {
            return std::ptr::null_mut();
        };
        let Some(grown) = new_size.checked_add(offset) else {
            return std::ptr::null_mut();
        };
        // SAFETY: as `dealloc` for the old block; the new one keeps the alignment and the offset,
        // so its header goes where `read_header` will look for it.
        unsafe {
            let (tag, size) = read_header(user);
            let base = System.realloc(user.sub(offset), block, grown);
            if base.is_null() {
                return base;
            }
            let user = base.add(offset);
            write_header(user, tag, new_size);
            charge(tag, new_size as i64 - size as i64);
            user
        }
    }
}

impl TrackingAllocator {
    /// # Safety
    /// `GlobalAlloc::alloc`'s: `layout` has a non-zero size.
    unsafe fn allocate(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        let Some((offset, block)) = whole(layout) else {
            return std::ptr::null_mut();
        };
        // SAFETY: `block` has a non-zero size (the header's offset alone is 16 bytes).
        let base = unsafe {
            match zeroed {
                true => System.alloc_zeroed(block),
                false => System.alloc(block),
            }
        };
        if base.is_null() {
            return base;
        }
        if !INSTALLED.load(Ordering::Relaxed) {
            INSTALLED.store(true, Ordering::Relaxed);
        }
        let tag = TAG.try_with(Cell::get).unwrap_or(NO_TAG);
        // SAFETY: `offset < block.size()`, and `user` is `offset ≥ 16` bytes into the block.
        unsafe {
            let user = base.add(offset);
            write_header(user, tag, layout.size());
            charge(tag, layout.size() as i64);
            user
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_charged_to_their_tag_until_freed() {
        let allocator = TrackingAllocator;
        let layout = Layout::from_size_align(1000, 8).unwrap();
        let wide = Layout::from_size_align(64, 64).unwrap();
        let tag = MAX_TAGS - 1;
        let _guard = TagGuard::set(Some(tag));
        assert_eq!(super::tag(), Some(tag));
        // SAFETY: every pointer goes back to the allocator with the layout it came with.
        unsafe {
            let a = allocator.alloc(layout);
            let b = allocator.alloc_zeroed(wide);
            assert_eq!(b as usize % 64, 0);
            assert!(std::slice::from_raw_parts(b, 64).iter().all(|&x| x == 0));
            assert_eq!(LIVE[tag].load(Ordering::Relaxed), 1064);
            let a = allocator.realloc(a, layout, 3000);
            assert_eq!(LIVE[tag].load(Ordering::Relaxed), 3064);
            // Freed on another thread: still this tag's.
            let (a, b) = (a as usize, b as usize);
            std::thread::spawn(move || {
                allocator.dealloc(a as *mut u8, Layout::from_size_align(3000, 8).unwrap());
                allocator.dealloc(b as *mut u8, wide);
            })
            .join()
            .unwrap();
        }
        assert_eq!(LIVE[tag].load(Ordering::Relaxed), 0);
        assert_eq!(PEAK[tag].load(Ordering::Relaxed), 3064);
        reset_peak(tag);
        assert_eq!(PEAK[tag].load(Ordering::Relaxed), 0);
        drop(_guard);
        assert_eq!(super::tag(), None);
    }

    #[test]
    fn the_process_peak_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(process_peak_bytes().unwrap() > 1 << 20);
        }
    }
}
