//! The seam between the cache's host logic and where its kernels run: [`Cuda`] (the
//! CUDA driver, loaded at run time, running the PTX of `kernels/cache.cu`) or, with the
//! `emulator` feature, [`Emulator`] (the same kernels compiled for the CPU; "device"
//! memory is host memory and every call completes before it returns).
//!
//! Pointers, streams and events cross as `u64` handles: a device pointer of the caller
//! (a tensor's `data_ptr`) and a stream of the caller (`torch.cuda.current_stream()
//! .cuda_stream`) are used as given.

use embank_core::{Error, ErrorKind, Result};

/// The kernels of `kernels/cache.cu`, by their index in the emulator's switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Find = 0,
    Fill = 1,
    Invalidate = 2,
    Refresh = 3,
    Count = 4,
    Pool = 5,
    TrainFind = 6,
    TrainPlace = 7,
    TrainUpdate = 8,
}

impl Kernel {
    const ALL: [Kernel; 9] = [
        Kernel::Find,
        Kernel::Fill,
        Kernel::Invalidate,
        Kernel::Refresh,
        Kernel::Count,
        Kernel::Pool,
        Kernel::TrainFind,
        Kernel::TrainPlace,
        Kernel::TrainUpdate,
    ];

    fn symbol(self) -> &'static [u8] {
        match self {
            Kernel::Find => b"embank_find\0",
            Kernel::Fill => b"embank_fill\0",
            Kernel::Invalidate => b"embank_invalidate\0",
            Kernel::Refresh => b"embank_refresh\0",
            Kernel::Count => b"embank_count\0",
            Kernel::Pool => b"embank_pool\0",
            Kernel::TrainFind => b"embank_train_find\0",
            Kernel::TrainPlace => b"embank_train_place\0",
            Kernel::TrainUpdate => b"embank_train_update\0",
        }
    }
}

/// A stream handle (`CUstream`; 0: the legacy default stream).
pub type Stream = u64;
/// An event handle (`CUevent`).
pub type Event = u64;

/// A device's context made current on the calling thread by [`Device::enter`], until
/// dropped: then the context the thread had before is current again, so a caller's
/// current device (PyTorch's, in a process with caches on several GPUs) is left as it
/// was. Entering a context already current costs a lookup and restores nothing.
#[must_use = "the device's context is current only while this lives"]
pub struct Entered {
    prev: usize,
    restore: Option<fn(usize)>,
    /// Bound to the thread it was made on.
    _thread: std::marker::PhantomData<*const ()>,
}

impl Entered {
    fn restoring(prev: usize, restore: fn(usize)) -> Entered {
        Entered { prev, restore: Some(restore), _thread: std::marker::PhantomData }
    }
    fn kept() -> Entered {
        Entered { prev: 0, restore: None, _thread: std::marker::PhantomData }
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        if let Some(r) = self.restore.take() {
            r(self.prev);
        }
    }
}

/// Where the kernels run. Every method may be called from any thread.
pub trait Device: Send + Sync {
    /// Makes the device's context current on the calling thread while the guard lives
    /// (every other method needs it current; nested enters are cheap).
    fn enter(&self) -> Result<Entered>;
    fn alloc(&self, bytes: usize) -> Result<u64>;
    /// # Safety
    /// `ptr` came from [`Device::alloc`] with `bytes`, and no launch uses it any more.
    unsafe fn free(&self, ptr: u64, bytes: usize);
    /// Page-locked host memory (not zeroed).
    fn alloc_host(&self, bytes: usize) -> Result<*mut u8>;
    /// # Safety
    /// `ptr` came from [`Device::alloc_host`] and no copy uses it any more.
    unsafe fn free_host(&self, ptr: *mut u8, bytes: usize);
    /// The device's address of pinned host memory from [`Device::alloc_host`] (mapped:
    /// a kernel may write there).
    fn host_device_ptr(&self, ptr: *mut u8) -> Result<u64>;
    fn memset(&self, dst: u64, byte: u8, bytes: usize, stream: Stream) -> Result<()>;
    /// # Safety
    /// `src` stays valid and unchanged until the copy is done (an event after it).
    unsafe fn htod(&self, dst: u64, src: *const u8, bytes: usize, stream: Stream) -> Result<()>;
    /// # Safety
    /// `dst` stays valid until the copy is done (an event after it).
    unsafe fn dtoh(&self, dst: *mut u8, src: u64, bytes: usize, stream: Stream) -> Result<()>;
    /// Launches `kernel` over `threads` threads (warps of 32) with its argument struct.
    fn launch(&self, kernel: Kernel, threads: u64, args: &[u8], stream: Stream) -> Result<()>;
    fn event(&self) -> Result<Event>;
    fn record(&self, event: Event, stream: Stream) -> Result<()>;
    /// The host waits for everything before the event's last record.
    fn wait(&self, event: Event) -> Result<()>;
    /// True when everything before the event's last record is done (no wait).
    fn done(&self, event: Event) -> Result<bool>;
    /// `stream` waits (on the device) for everything before the event's last record.
    fn stream_wait(&self, stream: Stream, event: Event) -> Result<()>;
    fn stream(&self) -> Result<Stream>;
    /// # Safety
    /// Nothing uses the event any more.
    unsafe fn drop_event(&self, event: Event);
    /// # Safety
    /// Nothing uses the stream any more.
    unsafe fn drop_stream(&self, stream: Stream);
    /// Names the device for errors and stats.
    fn name(&self) -> String;
}

/// The threads a block of a launch has (8 warps).
pub const BLOCK_THREADS: u64 = 256;

// ---- CUDA ----

use cudarc::driver::sys;

/// The PTX of `kernels/cache.cu` (tools/gpu_ptx.py writes it; `make test` checks it).
pub const PTX: &str = include_str!("../kernels/cache.ptx");

/// The CUDA driver on GPU `ordinal`, in its primary context (the one PyTorch uses).
pub struct Cuda {
    ordinal: i32,
    device: sys::CUdevice,
    ctx: usize,
    module: usize,
    functions: [usize; Kernel::ALL.len()],
}

fn check(rc: sys::CUresult, what: &str) -> Result<()> {
    if rc == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a static string's address or leaves it null.
    unsafe { sys::cuGetErrorString(rc, &mut text) };
    let text = if text.is_null() {
        format!("{rc:?}")
    } else {
        // SAFETY: a NUL-terminated static string of the driver.
        unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy().into_owned()
    };
    Err(Error::new(ErrorKind::Io, format!("CUDA {what} failed: {text} ({rc:?})")))
}

impl Cuda {
    /// The driver on GPU `ordinal`, with the kernels loaded (the driver compiles the PTX
    /// for the GPU at hand, once; it caches the result on disk).
    pub fn new(ordinal: i32) -> Result<Cuda> {
        // SAFETY: loading libcuda is a dlopen; absence is reported, not a crash.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "the GPU cache's native path needs NVIDIA's driver (libcuda.so), which this machine lacks",
            ));
        }
        // SAFETY: plain driver calls with out-pointers to locals.
        unsafe {
            check(sys::cuInit(0), "cuInit")?;
            let mut device: sys::CUdevice = 0;
            check(sys::cuDeviceGet(&mut device, ordinal), "cuDeviceGet")?;
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            check(sys::cuDevicePrimaryCtxRetain(&mut ctx, device), "cuDevicePrimaryCtxRetain")?;
            // The kernels loaded, or the context's retain given back (a failed start
            // leaks nothing).
            let loaded = (|| -> Result<(usize, [usize; Kernel::ALL.len()])> {
                let _cx = cuda_enter(ctx as usize)?;
                let ptx = std::ffi::CString::new(PTX).expect("PTX has no NUL");
                let mut module: sys::CUmodule = std::ptr::null_mut();
                check(
                    sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast()),
                    "loading the kernels (cuModuleLoadData)",
                )?;
                let mut functions = [0usize; Kernel::ALL.len()];
                for k in Kernel::ALL {
                    let mut f: sys::CUfunction = std::ptr::null_mut();
                    let rc = sys::cuModuleGetFunction(&mut f, module, k.symbol().as_ptr().cast());
                    if let Err(e) = check(rc, "cuModuleGetFunction") {
                        let _ = sys::cuModuleUnload(module);
                        return Err(e);
                    }
                    functions[k as usize] = f as usize;
                }
                Ok((module as usize, functions))
            })();
            match loaded {
                Ok((module, functions)) => Ok(Cuda { ordinal, device, ctx: ctx as usize, module, functions }),
                Err(e) => {
                    let _ = sys::cuDevicePrimaryCtxRelease_v2(device);
                    Err(e)
                }
            }
        }
    }
}

impl Drop for Cuda {
    fn drop(&mut self) {
        // SAFETY: the module and the context's retain are ours; nothing launches any more.
        unsafe {
            let _cx = cuda_enter(self.ctx);
            let _ = sys::cuModuleUnload(self.module as sys::CUmodule);
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

/// Makes `ctx` current on this thread until the guard drops (then the previous one).
fn cuda_enter(ctx: usize) -> Result<Entered> {
    let mut cur: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local.
    check(unsafe { sys::cuCtxGetCurrent(&mut cur) }, "cuCtxGetCurrent")?;
    if cur as usize == ctx {
        return Ok(Entered::kept());
    }
    // SAFETY: a context retained by its `Cuda` while that lives.
    check(unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) }, "cuCtxSetCurrent")?;
    Ok(Entered::restoring(cur as usize, |prev| {
        // SAFETY: the context that was current before (null: none); a context that
        // another owner released since is reported by the driver, not a crash.
        let _ = unsafe { sys::cuCtxSetCurrent(prev as sys::CUcontext) };
    }))
}

impl Device for Cuda {
    fn enter(&self) -> Result<Entered> {
        cuda_enter(self.ctx)
    }

    fn alloc(&self, bytes: usize) -> Result<u64> {
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: an out-pointer to a local.
        check(unsafe { sys::cuMemAlloc_v2(&mut p, bytes.max(1)) }, "cuMemAlloc")?;
        Ok(p)
    }

    unsafe fn free(&self, ptr: u64, _bytes: usize) {
        let _ = sys::cuMemFree_v2(ptr);
    }

    fn alloc_host(&self, bytes: usize) -> Result<*mut u8> {
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local. Flags: PORTABLE (1, every context) | DEVICEMAP
        // (2, mapped into the device's address space).
        check(unsafe { sys::cuMemHostAlloc(&mut p, bytes.max(1), 3) }, "cuMemHostAlloc")?;
        Ok(p.cast())
    }

    unsafe fn free_host(&self, ptr: *mut u8, _bytes: usize) {
        let _ = sys::cuMemFreeHost(ptr.cast());
    }

    fn host_device_ptr(&self, ptr: *mut u8) -> Result<u64> {
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: memory from cuMemHostAlloc with DEVICEMAP; an out-pointer to a local.
        check(unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, ptr.cast(), 0) }, "cuMemHostGetDevicePointer")?;
        Ok(d)
    }

    fn memset(&self, dst: u64, byte: u8, bytes: usize, stream: Stream) -> Result<()> {
        // SAFETY: dst is device memory of at least `bytes` (the caller's contract).
        check(unsafe { sys::cuMemsetD8Async(dst, byte, bytes, stream as sys::CUstream) }, "cuMemsetD8Async")
    }

    unsafe fn htod(&self, dst: u64, src: *const u8, bytes: usize, stream: Stream) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        check(sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, stream as sys::CUstream), "cuMemcpyHtoDAsync")
    }

    unsafe fn dtoh(&self, dst: *mut u8, src: u64, bytes: usize, stream: Stream) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        check(sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, stream as sys::CUstream), "cuMemcpyDtoHAsync")
    }

    fn launch(&self, kernel: Kernel, threads: u64, args: &[u8], stream: Stream) -> Result<()> {
        if threads == 0 {
            return Ok(());
        }
        let blocks = threads.div_ceil(BLOCK_THREADS);
        if blocks > i32::MAX as u64 {
            return Err(Error::new(ErrorKind::InvalidInput, format!("a launch of {threads} threads is too large")));
        }
        // The argument struct is the kernel's one parameter, copied by the driver.
        let mut buf = args.to_vec();
        let mut params = [buf.as_mut_ptr().cast::<std::ffi::c_void>()];
        // SAFETY: the function is loaded; params points at one struct of the kernel's
        // parameter type (same #[repr(C)] layout as cache.cu's), alive for the call.
        let rc = unsafe {
            sys::cuLaunchKernel(
                self.functions[kernel as usize] as sys::CUfunction,
                blocks as u32,
                1,
                1,
                BLOCK_THREADS as u32,
                1,
                1,
                0,
                stream as sys::CUstream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check(rc, "cuLaunchKernel")
    }

    fn event(&self) -> Result<Event> {
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local; flag 2: CU_EVENT_DISABLE_TIMING.
        check(unsafe { sys::cuEventCreate(&mut e, 2) }, "cuEventCreate")?;
        Ok(e as u64)
    }

    fn record(&self, event: Event, stream: Stream) -> Result<()> {
        // SAFETY: an event of ours, a stream of the caller's.
        check(unsafe { sys::cuEventRecord(event as sys::CUevent, stream as sys::CUstream) }, "cuEventRecord")
    }

    fn wait(&self, event: Event) -> Result<()> {
        // SAFETY: an event of ours.
        check(unsafe { sys::cuEventSynchronize(event as sys::CUevent) }, "cuEventSynchronize")
    }

    fn done(&self, event: Event) -> Result<bool> {
        // SAFETY: an event of ours.
        let rc = unsafe { sys::cuEventQuery(event as sys::CUevent) };
        if rc == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(rc, "cuEventQuery").map(|()| true)
    }

    fn stream_wait(&self, stream: Stream, event: Event) -> Result<()> {
        // SAFETY: an event of ours, a stream of the caller's.
        check(unsafe { sys::cuStreamWaitEvent(stream as sys::CUstream, event as sys::CUevent, 0) }, "cuStreamWaitEvent")
    }

    fn stream(&self) -> Result<Stream> {
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local; flag 1: CU_STREAM_NON_BLOCKING.
        check(unsafe { sys::cuStreamCreate(&mut s, 1) }, "cuStreamCreate")?;
        Ok(s as u64)
    }

    unsafe fn drop_event(&self, event: Event) {
        let _ = sys::cuEventDestroy_v2(event as sys::CUevent);
    }

    unsafe fn drop_stream(&self, stream: Stream) {
        let _ = sys::cuStreamDestroy_v2(stream as sys::CUstream);
    }

    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }
}

// ---- the CPU emulator ----

#[cfg(feature = "emulator")]
mod emulator {
    use super::*;
    use std::alloc::{alloc, dealloc, Layout};

    extern "C" {
        fn embank_emu_launch(kernel: u32, threads: u64, args: *const u8, args_len: u64) -> i32;
    }

    /// The kernels compiled for the CPU (kernels/emu.cpp): every call is done when it
    /// returns, streams and events are tokens. Its context is a token too, current per
    /// thread as a driver's is: every call outside [`Device::enter`] is refused (a
    /// panic where the call cannot fail), so the emulated tests check that the host
    /// logic enters before each driver call and restores the caller's context after.
    #[derive(Default)]
    pub struct Emulator;

    /// What the emulator's fresh device and pinned memory holds (0xA5 bytes: as an f32,
    /// -2.9e-16; as a u64 count, huge).
    pub const POISON: u8 = 0xA5;

    /// The emulator's context token.
    pub const EMULATOR_CONTEXT: usize = 0xE3;

    thread_local! {
        static CURRENT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// The context current on this thread (0: none; for tests).
    pub fn current_context() -> usize {
        CURRENT.with(|c| c.get())
    }

    /// Makes `token` this thread's current context (for tests: what a caller had).
    pub fn set_current_context(token: usize) {
        CURRENT.with(|c| c.set(token));
    }

    fn entered(what: &str) -> Result<()> {
        if current_context() == EMULATOR_CONTEXT {
            return Ok(());
        }
        Err(Error::new(ErrorKind::Corrupt, format!("emulator: {what} called without the device's context current")))
    }

    fn must_be_entered(what: &str) {
        if let Err(e) = entered(what) {
            panic!("{e}");
        }
    }

    fn layout(bytes: usize) -> Layout {
        Layout::from_size_align(bytes.max(1), 256).expect("a valid layout")
    }

    impl Device for Emulator {
        fn enter(&self) -> Result<Entered> {
            let prev = current_context();
            if prev == EMULATOR_CONTEXT {
                return Ok(Entered::kept());
            }
            set_current_context(EMULATOR_CONTEXT);
            Ok(Entered::restoring(prev, set_current_context))
        }
        fn alloc(&self, bytes: usize) -> Result<u64> {
            entered("alloc")?;
            // SAFETY: a non-zero size.
            let p = unsafe { alloc(layout(bytes)) };
            if p.is_null() {
                return Err(Error::new(ErrorKind::Io, format!("emulator: cannot allocate {bytes} bytes")));
            }
            // Neither cuMemAlloc nor cuMemHostAlloc zeroes: poison, so that the tests
            // fail where the host logic or a kernel reads memory nobody wrote.
            // SAFETY: just allocated, `bytes` long.
            unsafe { std::ptr::write_bytes(p, POISON, bytes) };
            Ok(p as u64)
        }
        unsafe fn free(&self, ptr: u64, bytes: usize) {
            must_be_entered("free");
            dealloc(ptr as *mut u8, layout(bytes));
        }
        fn alloc_host(&self, bytes: usize) -> Result<*mut u8> {
            Ok(self.alloc(bytes)? as *mut u8)
        }
        unsafe fn free_host(&self, ptr: *mut u8, bytes: usize) {
            must_be_entered("free_host");
            dealloc(ptr, layout(bytes));
        }
        fn host_device_ptr(&self, ptr: *mut u8) -> Result<u64> {
            entered("host_device_ptr")?;
            Ok(ptr as u64)
        }
        fn memset(&self, dst: u64, byte: u8, bytes: usize, _stream: Stream) -> Result<()> {
            entered("memset")?;
            // SAFETY: dst is emulated device memory (host memory) of `bytes` at least.
            unsafe { std::ptr::write_bytes(dst as *mut u8, byte, bytes) };
            Ok(())
        }
        unsafe fn htod(&self, dst: u64, src: *const u8, bytes: usize, _stream: Stream) -> Result<()> {
            entered("htod")?;
            std::ptr::copy_nonoverlapping(src, dst as *mut u8, bytes);
            Ok(())
        }
        unsafe fn dtoh(&self, dst: *mut u8, src: u64, bytes: usize, _stream: Stream) -> Result<()> {
            entered("dtoh")?;
            std::ptr::copy_nonoverlapping(src as *const u8, dst, bytes);
            Ok(())
        }
        fn launch(&self, kernel: Kernel, threads: u64, args: &[u8], _stream: Stream) -> Result<()> {
            entered("launch")?;
            if threads == 0 {
                return Ok(());
            }
            let threads = threads.div_ceil(BLOCK_THREADS) * BLOCK_THREADS;
            // SAFETY: args is the kernel's argument struct; the emulator checks its size.
            let rc = unsafe { embank_emu_launch(kernel as u32, threads, args.as_ptr(), args.len() as u64) };
            if rc != 0 {
                return Err(Error::new(ErrorKind::Corrupt, format!("emulator: launch of {kernel:?} refused ({rc})")));
            }
            Ok(())
        }
        fn event(&self) -> Result<Event> {
            entered("event")?;
            Ok(1)
        }
        fn record(&self, _event: Event, _stream: Stream) -> Result<()> {
            entered("record")
        }
        fn wait(&self, _event: Event) -> Result<()> {
            entered("wait")
        }
        fn done(&self, _event: Event) -> Result<bool> {
            entered("done")?;
            Ok(true)
        }
        fn stream_wait(&self, _stream: Stream, _event: Event) -> Result<()> {
            entered("stream_wait")
        }
        fn stream(&self) -> Result<Stream> {
            entered("stream")?;
            Ok(0)
        }
        unsafe fn drop_event(&self, _event: Event) {
            must_be_entered("drop_event");
        }
        unsafe fn drop_stream(&self, _stream: Stream) {
            must_be_entered("drop_stream");
        }
        fn name(&self) -> String {
            "emulator".to_owned()
        }
    }
}

#[cfg(feature = "emulator")]
pub use emulator::{current_context, set_current_context, Emulator, EMULATOR_CONTEXT};

#[cfg(test)]
mod tests {
    use super::*;

    /// `Cuda` keeps one function a kernel, indexed by the kernel's number (a table sized
    /// for fewer kernels than `Kernel::ALL` panicked at the first CUDA device made), and
    /// loads each by its symbol from the PTX.
    #[test]
    fn every_kernel_has_its_index_and_its_entry_in_the_ptx() {
        for (i, k) in Kernel::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i, "{k:?}");
            let name = std::str::from_utf8(&k.symbol()[..k.symbol().len() - 1]).unwrap();
            assert!(PTX.contains(&format!(".entry {name}(")), "{name} is not in the PTX");
        }
    }
}
