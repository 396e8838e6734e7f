//! The stand-in's semantics, pinned through its C entry points (the calls kvx-cuda makes).
//! Each test owns a device ordinal, so knobs never leak between tests running in parallel.

use std::ffi::{c_char, c_void};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{
    CUcontext, CUdeviceptr, CUdriverProcAddressQueryResult, CUevent, CUmemLocation,
    CUmemLocationType, CUmemcpyAttributes, CUmemcpySrcAccessOrder, CUresult, CUstream,
};

use crate::exports::*;
use crate::knobs::*;
use crate::memory::DEVICE_BASE;

const OK: CUresult = CUresult::CUDA_SUCCESS;

/// Initialise, retain device `ordinal`'s primary context, make it current, reset its knobs.
fn open(ordinal: i32) -> CUcontext {
    assert_eq!(cuInit(0), OK);
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: `ctx` is a live local.
    assert_eq!(unsafe { cuDevicePrimaryCtxRetain(&mut ctx, ordinal) }, OK);
    assert_eq!(cuCtxSetCurrent(ctx), OK);
    assert_eq!(kvx_standin_reset(ordinal), 0);
    ctx
}

fn stream() -> CUstream {
    let mut s: CUstream = std::ptr::null_mut();
    // SAFETY: `s` is a live local.
    assert_eq!(unsafe { cuStreamCreate(&mut s, 1) }, OK);
    s
}

fn event() -> CUevent {
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: `e` is a live local.
    assert_eq!(unsafe { cuEventCreate(&mut e, 0) }, OK);
    e
}

fn alloc(len: usize) -> CUdeviceptr {
    let mut p: CUdeviceptr = 0;
    // SAFETY: `p` is a live local.
    assert_eq!(unsafe { cuMemAlloc_v2(&mut p, len) }, OK);
    p
}

/// A host buffer registered with the driver for as long as it lives.
struct Pinned(Vec<u8>);

impl Pinned {
    fn new(len: usize, byte: u8) -> Pinned {
        let mut v = vec![byte; len];
        assert_eq!(cuMemHostRegister_v2(v.as_mut_ptr().cast(), len, 0), OK);
        Pinned(v)
    }

    fn ptr(&mut self) -> *mut c_void {
        self.0.as_mut_ptr().cast()
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        assert_eq!(cuMemHostUnregister(self.ptr()), OK);
    }
}

fn read_back(dev: CUdeviceptr, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    assert_eq!(cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), dev, len), OK);
    out
}

#[test]
fn nothing_completes_at_submit_and_a_stream_runs_in_order() {
    let ord = 1;
    open(ord);
    let (s, ev) = (stream(), event());
    let dev = alloc(4096);
    let (mut a, mut b, mut out) = (
        Pinned::new(4096, 1),
        Pinned::new(4096, 2),
        Pinned::new(4096, 0),
    );
    assert_eq!(cuEventQuery(ev), OK, "a never-recorded event is complete");
    kvx_standin_set_stalled(ord, 1);
    assert_eq!(cuMemcpyHtoDAsync_v2(dev, a.ptr(), 4096, s), OK);
    assert_eq!(cuMemcpyHtoDAsync_v2(dev, b.ptr(), 4096, s), OK);
    assert_eq!(cuMemcpyDtoHAsync_v2(out.ptr(), dev, 4096, s), OK);
    assert_eq!(cuEventRecord(ev, s), OK);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(cuEventQuery(ev), CUresult::CUDA_ERROR_NOT_READY);
    assert_eq!(kvx_standin_copies(ord), 0, "nothing ran at submit");
    assert!(
        out.0.iter().all(|&x| x == 0),
        "the destination is untouched"
    );
    let handle = ev as usize;
    let waiter = std::thread::spawn(move || {
        let t = Instant::now();
        (cuEventSynchronize(handle as CUevent), t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(50));
    kvx_standin_set_stalled(ord, 0);
    let (r, waited) = waiter.join().unwrap();
    assert_eq!(r, OK);
    assert!(
        waited >= Duration::from_millis(40),
        "the wait waited: {waited:?}"
    );
    assert_eq!(kvx_standin_copies(ord), 3);
    assert!(out.0.iter().all(|&x| x == 2), "copies ran in stream order");
    assert_eq!(cuStreamDestroy_v2(s), OK);
    assert_eq!(cuEventDestroy_v2(ev), OK);
}

#[test]
fn synchronous_calls_wait_for_the_streams() {
    let ord = 2;
    open(ord);
    let s = stream();
    let dev = alloc(1 << 16);
    let mut src = Pinned::new(1 << 16, 7);
    kvx_standin_set_stalled(ord, 1);
    for _ in 0..3 {
        assert_eq!(cuMemcpyHtoDAsync_v2(dev, src.ptr(), 1 << 16, s), OK);
    }
    assert_eq!(
        kvx_standin_copies(ord),
        0,
        "submit returned without running anything"
    );
    let handle = s as usize;
    let syncer = std::thread::spawn(move || cuStreamSynchronize(handle as CUstream));
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !syncer.is_finished(),
        "cuStreamSynchronize returned on a stalled stream"
    );
    kvx_standin_set_stalled(ord, 0);
    assert_eq!(syncer.join().unwrap(), OK);
    assert_eq!(
        kvx_standin_copies(ord),
        3,
        "cuStreamSynchronize returned before the copies ran"
    );
    assert_eq!(cuMemcpyHtoDAsync_v2(dev, src.ptr(), 1 << 16, s), OK);
    assert_eq!(cuCtxSynchronize(), OK);
    assert_eq!(
        kvx_standin_copies(ord),
        4,
        "cuCtxSynchronize waited for the stream"
    );
    assert_eq!(read_back(dev, 1 << 16), vec![7u8; 1 << 16]);
}

#[test]
fn each_stream_runs_on_its_own_thread() {
    let ord = 3;
    open(ord);
    let (s1, s2, ev2) = (stream(), stream(), event());
    let (d1, d2) = (alloc(64), alloc(64));
    let mut src = Pinned::new(64, 9);
    let ev1 = event();
    kvx_standin_set_copy_delay_us(ord, 2_000_000);
    assert_eq!(cuMemcpyHtoDAsync_v2(d1, src.ptr(), 64, s1), OK);
    assert_eq!(cuEventRecord(ev1, s1), OK);
    while kvx_standin_copies(ord) == 0 {
        std::thread::sleep(Duration::from_millis(1)); // s1's thread is inside its 2 s copy
    }
    kvx_standin_set_copy_delay_us(ord, 0);
    assert_eq!(cuMemcpyHtoDAsync_v2(d2, src.ptr(), 64, s2), OK);
    assert_eq!(cuEventRecord(ev2, s2), OK);
    assert_eq!(cuEventSynchronize(ev2), OK);
    assert_eq!(
        cuEventQuery(ev1),
        CUresult::CUDA_ERROR_NOT_READY,
        "stream 2 waited for stream 1's copy"
    );
    assert_eq!(cuStreamSynchronize(s1), OK);
    assert_eq!(read_back(d1, 64), vec![9u8; 64]);
}

#[test]
fn device_memory_is_its_own_mapping_at_non_host_addresses() {
    open(4);
    let dev = alloc(5000);
    assert!(dev >= DEVICE_BASE, "{dev:#x} could be a host pointer");
    let data: Vec<u8> = (0..5000).map(|i| i as u8).collect();
    assert_eq!(cuMemcpyHtoD_v2(dev, data.as_ptr().cast(), 5000), OK);
    assert_eq!(
        read_back(dev, 5000),
        data,
        "pageable host memory is fine synchronously"
    );
    assert_eq!(cuMemsetD8_v2(dev + 10, 0xEE, 10), OK);
    assert!(read_back(dev, 5000)[10..20].iter().all(|&x| x == 0xEE));
    assert_eq!(cuMemFree_v2(dev), OK);
    assert_eq!(
        cuMemcpyHtoD_v2(dev, data.as_ptr().cast(), 1),
        CUresult::CUDA_ERROR_INVALID_VALUE,
        "a freed allocation"
    );
}

#[test]
fn copies_out_of_range_or_from_unregistered_memory_are_errors() {
    let ord = 5;
    open(ord);
    let s = stream();
    let dev = alloc(4096);
    let mut pinned = Pinned::new(4096, 3);
    let mut pageable = vec![0u8; 4096];
    let bad = CUresult::CUDA_ERROR_INVALID_VALUE;
    assert_eq!(
        cuMemcpyHtoDAsync_v2(dev, pageable.as_mut_ptr().cast(), 4096, s),
        bad,
        "async copies need registered memory"
    );
    assert_eq!(cuMemcpyDtoHAsync_v2(pinned.ptr(), dev + 1, 4096, s), bad);
    assert_eq!(
        cuMemcpyDtoHAsync_v2(pinned.ptr().wrapping_byte_add(1), dev, 4096, s),
        bad,
        "runs past the registration"
    );
    assert_eq!(
        cuMemcpyHtoD_v2(dev + 4096, pageable.as_ptr().cast(), 1),
        bad
    );
    assert_eq!(cuMemcpyHtoD_v2(0x1234, pageable.as_ptr().cast(), 1), bad);
    assert_eq!(
        cuStreamSynchronize(0xdead_0000 as CUstream),
        CUresult::CUDA_ERROR_INVALID_HANDLE
    );
    // The batch copy names the first bad entry and queues nothing.
    let host = pinned.ptr() as CUdeviceptr;
    let (r, fail) = batch(s, &[(dev, host, 64), (dev + 4000, host, 200)]);
    assert_eq!((r, fail), (bad, 1));
    assert_eq!(cuStreamSynchronize(s), OK);
    assert_eq!(kvx_standin_copies(ord), 0, "nothing of the bad batch ran");
    // Without a current context: an error, not a crash.
    let other = std::thread::spawn(move || alloc_result(16)).join().unwrap();
    assert_eq!(other, CUresult::CUDA_ERROR_INVALID_CONTEXT);
}

fn alloc_result(len: usize) -> CUresult {
    let mut p: CUdeviceptr = 0;
    // SAFETY: `p` is a live local.
    unsafe { cuMemAlloc_v2(&mut p, len) }
}

/// `cuMemcpyBatchAsync` of `(dst, src, len)` copies on `s`: its result and the failed index.
fn batch(s: CUstream, copies: &[(CUdeviceptr, CUdeviceptr, usize)]) -> (CUresult, usize) {
    let mut dsts: Vec<CUdeviceptr> = copies.iter().map(|c| c.0).collect();
    let mut srcs: Vec<CUdeviceptr> = copies.iter().map(|c| c.1).collect();
    let mut sizes: Vec<usize> = copies.iter().map(|c| c.2).collect();
    let (mut attrs, mut idx, mut fail) = (batch_attrs(), [0usize], usize::MAX);
    // SAFETY: every array holds `copies.len()` entries (one attribute); `fail` is a live local.
    let r = unsafe {
        cu_memcpy_batch_async(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            copies.len(),
            attrs.as_mut_ptr(),
            idx.as_mut_ptr(),
            1,
            &mut fail,
            s,
        )
    };
    (r, fail)
}

fn batch_attrs() -> [CUmemcpyAttributes; 1] {
    let loc = CUmemLocation {
        type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
        id: 0,
    };
    [CUmemcpyAttributes {
        srcAccessOrder: CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: loc,
        dstLocHint: loc,
        flags: 0,
    }]
}

#[test]
fn a_sticky_error_fails_every_later_call_until_the_context_is_released() {
    let ord = 6;
    open(ord);
    let (s, ev) = (stream(), event());
    let dev = alloc(4096);
    let mut src = vec![5u8; 4096];
    let host: *mut c_void = src.as_mut_ptr().cast();
    assert_eq!(cuMemHostRegister_v2(host, 4096, 0), OK);
    kvx_standin_fail_after_copies(ord, 2);
    for _ in 0..4 {
        assert_eq!(cuMemcpyHtoDAsync_v2(dev, host, 4096, s), OK);
    }
    assert_eq!(cuEventRecord(ev, s), OK);
    let illegal = CUresult::CUDA_ERROR_ILLEGAL_ADDRESS;
    assert_eq!(cuEventSynchronize(ev), illegal);
    assert_eq!(
        kvx_standin_copies(ord),
        3,
        "two ran, the third faulted, the rest were dropped"
    );
    assert_eq!(cuStreamSynchronize(s), illegal);
    assert_eq!(cuCtxSynchronize(), illegal);
    assert_eq!(alloc_result(16), illegal);
    assert_eq!(cuMemcpyHtoDAsync_v2(dev, host, 4096, s), illegal);
    assert_eq!(cuEventRecord(ev, s), illegal);
    // Releasing the context ends it, its registrations with it.
    assert_eq!(cuDevicePrimaryCtxRelease_v2(ord), OK);
    assert_eq!(cuCtxSetCurrent(std::ptr::null_mut()), OK);
    open(ord);
    let fresh = alloc(16);
    assert_eq!(read_back(fresh, 16), vec![0u8; 16], "a fresh context works");
    assert_eq!(
        cuMemHostRegister_v2(host, 4096, 0),
        OK,
        "the old registration went with it"
    );
    assert_eq!(cuMemHostUnregister(host), OK);
    drop(src);
}

#[test]
fn a_hung_stream_holds_its_events_until_resumed() {
    let ord = 7;
    open(ord);
    let (s, ev) = (stream(), event());
    let dev = alloc(64);
    let mut src = Pinned::new(64, 1);
    kvx_standin_set_stalled(ord, 1);
    assert_eq!(cuMemcpyHtoDAsync_v2(dev, src.ptr(), 64, s), OK);
    assert_eq!(cuEventRecord(ev, s), OK);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(cuEventQuery(ev), CUresult::CUDA_ERROR_NOT_READY);
    kvx_standin_set_stalled(ord, 0);
    assert_eq!(cuEventSynchronize(ev), OK);
    assert_eq!(read_back(dev, 64), vec![1u8; 64]);
}

#[test]
fn registration_limit_and_batch_availability_knobs() {
    let ord = 8;
    open(ord);
    kvx_standin_set_register_limit(ord, 8192);
    let mut big = vec![0u8; 16384];
    assert_eq!(
        cuMemHostRegister_v2(big.as_mut_ptr().cast(), 16384, 0),
        CUresult::CUDA_ERROR_OUT_OF_MEMORY
    );
    assert_eq!(cuMemHostRegister_v2(big.as_mut_ptr().cast(), 8192, 0), OK);
    assert_eq!(
        cuMemHostRegister_v2(big.as_mut_ptr().cast(), 4096, 0),
        CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
    );
    assert_eq!(cuMemHostUnregister(big.as_mut_ptr().cast()), OK);

    let lookup = |version| {
        let mut pfn: *mut c_void = std::ptr::null_mut();
        let mut st = CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS;
        let name: *const c_char = c"cuMemcpyBatchAsync".as_ptr();
        // SAFETY: NUL-terminated name, live out-pointers.
        let r = unsafe { cuGetProcAddress_v2(name, &mut pfn, version, 0, &mut st) };
        (r, st, pfn.is_null())
    };
    let found = (
        OK,
        CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS,
        false,
    );
    let missing = (
        CUresult::CUDA_ERROR_NOT_FOUND,
        CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
        true,
    );
    assert_eq!(lookup(12080), found);
    assert_eq!(lookup(12000), missing, "asked for a version before 12.8");
    kvx_standin_set_batch_copy(0);
    assert_eq!(lookup(12080), missing, "a driver without the batch copy");
    kvx_standin_set_batch_copy(1);
    assert_eq!(lookup(12080), found);
}

#[test]
fn the_batch_copy_runs_every_entry_in_order() {
    let ord = 9;
    open(ord);
    let s = stream();
    let dev = alloc(8192);
    let mut a = Pinned::new(4096, 0xA);
    let mut out = Pinned::new(8192, 0);
    let (ha, ho) = (a.ptr() as CUdeviceptr, out.ptr() as CUdeviceptr);
    let (r, _) = batch(
        s,
        &[(dev, ha, 4096), (dev + 4096, ha, 4096), (ho, dev, 8192)],
    );
    assert_eq!(r, OK);
    assert_eq!(cuStreamSynchronize(s), OK);
    assert_eq!(kvx_standin_copies(ord), 3, "one copy per entry");
    assert!(out.0.iter().all(|&x| x == 0xA));
}

/// A host function that sleeps for `data` milliseconds: a slow "kernel".
extern "C" fn sleep_ms(data: *mut c_void) {
    std::thread::sleep(Duration::from_millis(data as u64));
}

/// A host function that adds one to the `AtomicU64` at `data`.
extern "C" fn bump(data: *mut c_void) {
    // SAFETY: the tests pass a pointer to an AtomicU64 that outlives the stream's work.
    let counter = unsafe { &*(data as *const std::sync::atomic::AtomicU64) };
    counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

/// Queue a sleep of `ms` on `s`.
fn launch_sleep(s: CUstream, ms: u64) {
    assert_eq!(cuLaunchHostFunc(s, Some(sleep_ms), ms as *mut c_void), OK);
}

#[test]
fn a_wait_holds_a_stream_until_another_streams_record() {
    let ord = 10;
    open(ord);
    let (engine, copier, unordered) = (stream(), stream(), stream());
    let (forward, copied, early) = (event(), event(), event());
    let dev = alloc(4096);
    let (mut before, mut after) = (Pinned::new(4096, 0x11), Pinned::new(4096, 0x22));
    let (mut out, mut out_early) = (Pinned::new(4096, 0), Pinned::new(4096, 0));
    assert_eq!(cuMemcpyHtoD_v2(dev, before.ptr(), 4096), OK);
    // The "forward": busy for 200 ms, then it writes the final bytes.
    let t0 = Instant::now();
    launch_sleep(engine, 200);
    assert_eq!(cuMemcpyHtoDAsync_v2(dev, after.ptr(), 4096, engine), OK);
    assert_eq!(cuEventRecord(forward, engine), OK);
    assert_eq!(cuStreamWaitEvent(copier, forward, 0), OK);
    let queued = t0.elapsed();
    assert!(
        queued < Duration::from_millis(50),
        "queueing waited: {queued:?}"
    );
    assert_eq!(cuMemcpyDtoHAsync_v2(out.ptr(), dev, 4096, copier), OK);
    assert_eq!(cuEventRecord(copied, copier), OK);
    // A stream that does not wait reads the block at once: streams are not ordered otherwise.
    assert_eq!(
        cuMemcpyDtoHAsync_v2(out_early.ptr(), dev, 4096, unordered),
        OK
    );
    assert_eq!(cuEventRecord(early, unordered), OK);
    assert_eq!(cuEventSynchronize(early), OK);
    assert!(
        t0.elapsed() < Duration::from_millis(200),
        "the unordered copy waited"
    );
    assert!(
        out_early.0.iter().all(|&x| x == 0x11),
        "it read the bytes before the forward"
    );
    assert_eq!(cuEventQuery(copied), CUresult::CUDA_ERROR_NOT_READY);
    assert_eq!(cuEventSynchronize(copied), OK);
    assert!(
        t0.elapsed() >= Duration::from_millis(200),
        "the ordered copy ran before the forward's record: {:?}",
        t0.elapsed()
    );
    assert!(
        out.0.iter().all(|&x| x == 0x22),
        "it read the forward's bytes"
    );
}

#[test]
fn a_wait_captures_the_record_made_before_it() {
    let ord = 11;
    open(ord);
    let (slow, waiter, idle) = (stream(), stream(), stream());
    let (ev, done) = (event(), event());
    let t0 = Instant::now();
    launch_sleep(slow, 200);
    assert_eq!(cuEventRecord(ev, slow), OK);
    assert_eq!(cuStreamWaitEvent(waiter, ev, 0), OK);
    assert_eq!(cuEventRecord(done, waiter), OK);
    // Recording the event again, on an idle stream, does not release the wait queued before.
    assert_eq!(cuEventRecord(ev, idle), OK);
    assert_eq!(
        cuEventSynchronize(ev),
        OK,
        "the new record completes at once"
    );
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        cuEventQuery(done),
        CUresult::CUDA_ERROR_NOT_READY,
        "the wait was released by a later record"
    );
    assert_eq!(cuEventSynchronize(done), OK);
    assert!(
        t0.elapsed() >= Duration::from_millis(200),
        "{:?}",
        t0.elapsed()
    );
    // A wait queued now captures the idle stream's record: nothing to wait for.
    launch_sleep(slow, 200);
    let t1 = Instant::now();
    assert_eq!(cuStreamWaitEvent(waiter, ev, 0), OK);
    assert_eq!(cuEventRecord(done, waiter), OK);
    assert_eq!(cuEventSynchronize(done), OK);
    assert!(
        t1.elapsed() < Duration::from_millis(150),
        "{:?}",
        t1.elapsed()
    );
    assert_eq!(cuStreamSynchronize(slow), OK);
}

#[test]
fn host_functions_the_default_stream_and_bad_arguments() {
    let ord = 12;
    let ctx = open(ord);
    let mut current: CUcontext = std::ptr::null_mut();
    // SAFETY: `current` is a live local.
    assert_eq!(unsafe { cuCtxGetCurrent(&mut current) }, OK);
    assert_eq!(current, ctx);
    let counter = std::sync::atomic::AtomicU64::new(0);
    let arg = &counter as *const std::sync::atomic::AtomicU64 as *mut c_void;
    let dev = alloc(64);
    let mut src = Pinned::new(64, 0x33);
    // The default stream (0) runs host functions and copies in order.
    launch_sleep(std::ptr::null_mut(), 50);
    assert_eq!(cuLaunchHostFunc(std::ptr::null_mut(), Some(bump), arg), OK);
    assert_eq!(
        cuMemcpyHtoDAsync_v2(dev, src.ptr(), 64, std::ptr::null_mut()),
        OK
    );
    assert_eq!(
        counter.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the host function ran at submit"
    );
    assert_eq!(cuStreamSynchronize(std::ptr::null_mut()), OK);
    assert_eq!(counter.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(read_back(dev, 64), vec![0x33; 64]);
    // A record on the default stream orders another stream after it.
    let (ev, s) = (event(), stream());
    launch_sleep(std::ptr::null_mut(), 100);
    assert_eq!(cuEventRecord(ev, std::ptr::null_mut()), OK);
    assert_eq!(cuStreamWaitEvent(s, ev, 0), OK);
    assert_eq!(cuLaunchHostFunc(s, Some(bump), arg), OK);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        counter.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "ran before the wait"
    );
    assert_eq!(cuStreamSynchronize(s), OK);
    assert_eq!(counter.load(std::sync::atomic::Ordering::SeqCst), 2);
    // A never-recorded event is nothing to wait for.
    let (fresh, fresh_s) = (event(), stream());
    assert_eq!(cuStreamWaitEvent(fresh_s, fresh, 0), OK);
    assert_eq!(cuStreamSynchronize(fresh_s), OK);
    let bad = CUresult::CUDA_ERROR_INVALID_VALUE;
    assert_eq!(cuLaunchHostFunc(s, None, std::ptr::null_mut()), bad);
    assert_eq!(cuStreamWaitEvent(s, ev, 1), bad, "only flags 0");
    assert_eq!(
        cuStreamWaitEvent(0xdead_0000 as CUstream, ev, 0),
        CUresult::CUDA_ERROR_INVALID_HANDLE
    );
    assert_eq!(
        cuStreamWaitEvent(s, 0xdead_0000 as CUevent, 0),
        CUresult::CUDA_ERROR_INVALID_HANDLE
    );
    let host = src.ptr() as CUdeviceptr;
    let (r, _) = batch(std::ptr::null_mut(), &[(dev, host, 64)]);
    assert_eq!(r, bad, "the batch copy needs a created stream");
    // SAFETY: a null out-pointer is refused, not written.
    assert_eq!(unsafe { cuCtxGetCurrent(std::ptr::null_mut()) }, bad);
    let other = std::thread::spawn(|| {
        let mut c: CUcontext = 0x10 as CUcontext;
        // SAFETY: `c` is a live local.
        let r = unsafe { cuCtxGetCurrent(&mut c) };
        (r, c.is_null())
    });
    assert_eq!(
        other.join().unwrap(),
        (OK, true),
        "no context is current there"
    );
}
