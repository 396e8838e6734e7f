//! Poison-tolerant locking, written once.
//!
//! kvx never leaves shared state half-updated across a panic that matters (the driver records
//! a panic and stops; backends hand completions over whole), so a poisoned mutex still guards
//! consistent data: these helpers take the guard either way instead of propagating the panic
//! to every later caller.

use std::sync::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

/// Lock `m`, ignoring poisoning.
///
/// ```
/// let m = std::sync::Mutex::new(1);
/// *kvx_core::lock(&m) += 1;
/// assert_eq!(*kvx_core::lock(&m), 2);
/// ```
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Wait on `cv` for at most `dur`, ignoring poisoning; returns the guard (spurious wake-ups
/// happen: callers re-check their condition).
pub fn wait_timeout<'a, T>(
    cv: &Condvar,
    guard: MutexGuard<'a, T>,
    dur: Duration,
) -> MutexGuard<'a, T> {
    cv.wait_timeout(guard, dur)
        .unwrap_or_else(|e| e.into_inner())
        .0
}

/// Wait on `cv` until notified, ignoring poisoning (spurious wake-ups happen: callers re-check
/// their condition).
pub fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(guard).unwrap_or_else(|e| e.into_inner())
}

/// Read-lock `l`, ignoring poisoning (a panicked writer leaves a value that is still usable).
pub fn read<T: ?Sized>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

/// Write-lock `l`, ignoring poisoning.
pub fn write<T: ?Sized>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|e| e.into_inner())
}
