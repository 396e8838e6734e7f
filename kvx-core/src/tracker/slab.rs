//! A slab: values in one vector, addressed by a `u32` index. A freed slot is the next one
//! reused (last freed, first reused), so a busy tracker keeps touching the same few slots, hot
//! in cache, and allocates nothing once the vector has grown to the peak number in flight.

/// The index of no slot (the end of a list).
pub(super) const NIL: u32 = u32::MAX;

#[derive(Debug)]
enum Slot<T> {
    Used(T),
    /// Free; the next free slot (or `NIL`).
    Free(u32),
}

/// Values addressed by index; see the module comment.
#[derive(Debug)]
pub(super) struct Slab<T> {
    slots: Vec<Slot<T>>,
    free: u32,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            slots: Vec::new(),
            free: NIL,
            len: 0,
        }
    }
}

impl<T> Slab<T> {
    /// The slot `insert` fills next.
    pub(super) fn next_slot(&self) -> u32 {
        if self.free == NIL {
            u32::try_from(self.slots.len()).unwrap_or(NIL)
        } else {
            self.free
        }
    }

    /// Store `v`; returns its slot.
    ///
    /// # Panics
    /// With `u32::MAX` values stored at once (the tracker's limit on live tasks and ops).
    #[inline]
    pub(super) fn insert(&mut self, v: T) -> u32 {
        let i = self.next_slot();
        assert!(i != NIL, "more than u32::MAX - 1 entries in a tracker slab");
        self.len += 1;
        match self.slots.get_mut(i as usize) {
            // Written in place: no copy of the old slot comes back.
            Some(slot) => {
                if let Slot::Free(next) = *slot {
                    self.free = next;
                }
                *slot = Slot::Used(v);
            }
            None => self.slots.push(Slot::Used(v)),
        }
        i
    }

    /// Take the value out of slot `i` (`None` if the slot is free).
    pub(super) fn remove(&mut self, i: u32) -> Option<T> {
        let slot = self.slots.get_mut(i as usize)?;
        if matches!(slot, Slot::Free(_)) {
            return None;
        }
        let Slot::Used(v) = std::mem::replace(slot, Slot::Free(self.free)) else {
            return None;
        };
        self.free = i;
        self.len -= 1;
        Some(v)
    }

    /// Drop the value in slot `i` where it lies; false if the slot is free.
    #[inline]
    pub(super) fn free(&mut self, i: u32) -> bool {
        let Some(slot) = self.slots.get_mut(i as usize) else {
            return false;
        };
        if matches!(slot, Slot::Free(_)) {
            return false;
        }
        *slot = Slot::Free(self.free);
        self.free = i;
        self.len -= 1;
        true
    }

    pub(super) fn get(&self, i: u32) -> Option<&T> {
        match self.slots.get(i as usize) {
            Some(Slot::Used(v)) => Some(v),
            _ => None,
        }
    }

    pub(super) fn get_mut(&mut self, i: u32) -> Option<&mut T> {
        match self.slots.get_mut(i as usize) {
            Some(Slot::Used(v)) => Some(v),
            _ => None,
        }
    }

    /// Every stored value with its slot.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| match s {
            Slot::Used(v) => Some((i as u32, v)),
            Slot::Free(_) => None,
        })
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_slots_are_reused_last_freed_first() {
        let mut s = Slab::default();
        let (a, b, c) = (s.insert('a'), s.insert('b'), s.insert('c'));
        assert_eq!((a, b, c), (0, 1, 2));
        assert_eq!(s.remove(a), Some('a'));
        assert_eq!(s.remove(a), None, "a free slot holds nothing");
        assert!(s.free(c));
        assert!(!s.free(c), "a free slot is freed once");
        assert_eq!(s.next_slot(), c);
        assert_eq!(s.insert('d'), c);
        assert_eq!(s.insert('e'), a);
        assert_eq!(s.insert('f'), 3);
        assert_eq!(s.len(), 4);
        let all: Vec<(u32, char)> = s.iter().map(|(i, v)| (i, *v)).collect();
        assert_eq!(all, vec![(0, 'e'), (1, 'b'), (2, 'd'), (3, 'f')]);
        assert_eq!(s.get(7), None);
        *s.get_mut(1).unwrap() = 'B';
        assert_eq!(s.get(1), Some(&'B'));
    }
}
