//! A request's entry and its live tasks, in submission order: a doubly linked list threaded
//! through the task slab (`prev` and `next` of each task), so a task joins and leaves its
//! request in O(1) whatever the number of tasks the request has.

use std::collections::hash_map::Entry;

use super::slab::NIL;
use super::{RequestEntry, Tracker};
use crate::ids::RequestId;

impl Tracker {
    /// The slot of `req`'s entry, made if it has none.
    pub(super) fn request_slot(&mut self, req: RequestId) -> u32 {
        match self.request_slots.entry(req) {
            Entry::Occupied(e) => *e.get(),
            Entry::Vacant(v) => *v.insert(self.requests.insert(RequestEntry {
                id: req,
                first_task: NIL,
                last_task: NIL,
                tasks: 0,
                zombies: Vec::new(),
                finished: false,
                report_release: false,
            })),
        }
    }

    /// Drop the entry in slot `rs`.
    pub(super) fn drop_request(&mut self, rs: u32) -> Option<RequestEntry> {
        let r = self.requests.remove(rs)?;
        self.request_slots.remove(&r.id);
        Some(r)
    }

    /// Append the task in `slot` to its request's list.
    pub(super) fn link_task(&mut self, slot: u32) {
        let Some(t) = self.tasks.get_mut(slot) else {
            return;
        };
        let Some(r) = self.requests.get_mut(t.req_slot) else {
            return;
        };
        t.prev = r.last_task;
        t.next = NIL;
        let prev = std::mem::replace(&mut r.last_task, slot);
        r.tasks += 1;
        if prev == NIL {
            r.first_task = slot;
        } else if let Some(p) = self.tasks.get_mut(prev) {
            p.next = slot;
        }
    }

    /// Take the task in `slot` out of its request's list.
    pub(super) fn unlink_task(&mut self, slot: u32) {
        let Some(t) = self.tasks.get(slot) else {
            return;
        };
        let (prev, next, rs) = (t.prev, t.next, t.req_slot);
        match self.tasks.get_mut(prev) {
            Some(p) => p.next = next,
            None => {
                if let Some(r) = self.requests.get_mut(rs) {
                    r.first_task = next;
                }
            }
        }
        match self.tasks.get_mut(next) {
            Some(n) => n.prev = prev,
            None => {
                if let Some(r) = self.requests.get_mut(rs) {
                    r.last_task = prev;
                }
            }
        }
        if let Some(r) = self.requests.get_mut(rs) {
            r.tasks -= 1;
        }
    }

    /// Append the slots of the live tasks of the request in `rs` to `out`, oldest first.
    pub(super) fn request_tasks(&self, rs: u32, out: &mut Vec<u32>) {
        let mut at = self.requests.get(rs).map_or(NIL, |r| r.first_task);
        while let Some(t) = self.tasks.get(at) {
            out.push(at);
            at = t.next;
        }
    }
}
