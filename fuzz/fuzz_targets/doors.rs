//! Fuzz target `doors`: the session API's and the inference doors' request decoding, in
//! process; the harness and its invariants are in `fuzz/harness/doors.rs`.
//!
//! Run: `bash scripts/dev.sh fuzz [SECONDS] doors`.

#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::Ordering;

#[path = "../harness/doors.rs"]
mod harness;

/// The system allocator, counting the bytes allocated now ([`harness::LIVE`]) and the most
/// at once ([`harness::PEAK`]), for the harness's bounded-allocation invariant.
struct Counting;

// SAFETY: every method forwards to `System` with the caller's own arguments, so `System`'s
// guarantees are the caller's; the counters are plain atomics that never allocate (no
// reentrancy) and never influence what is returned.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `alloc`'s contract, which is `System.alloc`'s.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (every allocation goes
        // through this allocator), as the caller guarantees.
        unsafe { System.dealloc(ptr, layout) };
        harness::LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `dealloc` for `ptr` and `layout`; `new_size` is the caller's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // Old and new blocks are both held during the copy: count the new one first.
            grow(new_size);
            harness::LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

fn grow(n: usize) {
    let now = harness::LIVE.fetch_add(n, Ordering::Relaxed) + n;
    harness::PEAK.fetch_max(now, Ordering::Relaxed);
}

#[global_allocator]
static ALLOC: Counting = Counting;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run_bytes(data));
