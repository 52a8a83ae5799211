//! Which settled deliveries a broker that confirms a position can confirm now. An AMQP
//! `multiple` ack covers every earlier tag of the channel, and an offset log commits one
//! offset for everything before it: either way only the contiguous settled range from the
//! oldest unsettled delivery goes at once. Settled deliveries beyond a gap wait for it, unless
//! more than `hold` of them wait: then they are confirmed one by one (where the broker can),
//! so one slow handler cannot pin the whole window; and when the consumer closes.
//!
//! It owns the bookkeeping only, by position (a tag, an offset): it sends nothing and knows no
//! broker.

use std::collections::BTreeMap;

/// The deliveries of one consumer not yet confirmed, by position, and whether each is settled.
#[derive(Debug, Default)]
pub struct AckWindow {
    outstanding: BTreeMap<u64, bool>,
    hold: usize,
}

impl AckWindow {
    /// A window that confirms one by one once more than `hold` settled deliveries wait.
    pub fn new(hold: usize) -> AckWindow {
        AckWindow { outstanding: BTreeMap::new(), hold }
    }

    /// A delivery arrived.
    pub fn received(&mut self, tag: u64) {
        self.outstanding.insert(tag, false);
    }

    /// Marks deliveries settled; the confirmations to send now, as `(position, multiple)`, in
    /// order (`multiple`: every earlier position with it).
    pub fn settle(&mut self, tags: impl IntoIterator<Item = u64>) -> Vec<(u64, bool)> {
        for tag in tags {
            self.outstanding.insert(tag, true);
        }
        let mut acks = Vec::new();
        let mut last = None;
        while let Some(entry) = self.outstanding.first_entry() {
            if !*entry.get() {
                break;
            }
            last = Some(entry.remove_entry().0);
        }
        acks.extend(last.map(|tag| (tag, true)));
        let waiting = self.outstanding.values().filter(|settled| **settled).count();
        if waiting > self.hold {
            self.outstanding.retain(|tag, settled| {
                if *settled {
                    acks.push((*tag, false));
                }
                !*settled
            });
        }
        acks
    }

    /// Takes the settled deliveries waiting behind an unsettled one, to be acked one by one
    /// before the consumer closes (closing would send them back with the unsettled ones).
    pub fn take_settled(&mut self) -> Vec<u64> {
        let settled: Vec<u64> = self.outstanding.iter().filter(|(_, settled)| **settled).map(|(tag, _)| *tag).collect();
        self.outstanding.retain(|_, settled| !*settled);
        settled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tags received, tags settled, and the acks expected then.
    type Step<'a> = (&'a [u64], &'a [u64], &'a [(u64, bool)]);

    #[test]
    fn acks_by_window() {
        // Applied in order to one window with hold 2.
        let steps: &[Step] = &[
            (&[1, 2, 3, 4, 5, 6], &[], &[]),
            (&[], &[2], &[]),
            (&[], &[1], &[(2, true)]),
            (&[], &[4, 5], &[]),
            // A third settled delivery behind the gap at 3: over the hold, acked one by one.
            (&[], &[6], &[(4, false), (5, false), (6, false)]),
            (&[7], &[3], &[(3, true)]),
            (&[], &[7], &[(7, true)]),
        ];
        let mut window = AckWindow::new(2);
        for (i, (received, settled, want)) in steps.iter().enumerate() {
            for tag in *received {
                window.received(*tag);
            }
            assert_eq!(window.settle(settled.iter().copied()), *want, "step {i}");
        }
        assert!(window.outstanding.is_empty());
    }

    #[test]
    fn what_waits_behind_a_gap_is_taken_at_close() {
        let mut window = AckWindow::new(4);
        for tag in 1..=5 {
            window.received(tag);
        }
        assert_eq!(window.settle([3, 5]), []);
        assert_eq!(window.take_settled(), [3, 5]);
        assert_eq!(window.take_settled(), Vec::<u64>::new());
        // What is left unsettled still acks as before.
        assert_eq!(window.settle([1, 2]), [(2, true)]);
    }
}
