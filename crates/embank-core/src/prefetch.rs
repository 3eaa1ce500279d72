//! Software prefetch hints; no-ops where the target has none.

/// Hints the CPU to fetch the line at `ptr` into every cache level (`prefetcht0`), so a
/// load of it a little later need not wait. Any address, mapped or not.
#[inline(always)]
pub fn prefetch_read(ptr: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(ptr as *const i8, std::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ptr;
}

/// Hints the CPU to fetch a line for writing (`prefetchw` where the CPU has it), so a
/// store to a line not in the cache need not wait for it.
#[inline(always)]
pub fn prefetch_write(ptr: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(ptr as *const i8, std::arch::x86_64::_MM_HINT_ET0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ptr;
}
