//! One consumer's claim loop, for the brokers that keep their own messages. [`Holder`] is
//! what a consumer holds (its unsettled deliveries, the bytes its stream holds unread, its
//! cancel and close); [`start`] runs the task that claims what fits its prefetch when woken,
//! hands it to the stream (or back, when the consumer closed meanwhile), and ends with the
//! consumer. The broker says how through [`Claimer`]: claim, hand back, retire (stop counting
//! the consumer), end, and what wakes it.
//!
//! It owns the order of things: a wake-up is armed before each claim (none is lost between
//! the claim and the wait), nothing is delivered after a close, a claim takes no more than the
//! prefetch and [`CLAIM_BYTES`] leave room for (large messages are claimed a few at a time),
//! and the task ends when every handle to the consumer is gone (its leases then run out, as a
//! killed process's do). It must not touch storage, nor renew leases: a broker renews in its
//! claim, or for all its consumers at once, on a [`Renewal`](super::lease::Renewal).

use std::borrow::Borrow;
use std::collections::BTreeSet;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

use super::kept::{CLAIM_BYTES, Kept, KeptDeliveries};
use super::lock;
use crate::broker::BrokerError;

/// The most messages one claim takes: a claim holds its store (a transaction, a script) while
/// it runs.
pub const CLAIM_MAX: usize = 1024;

/// What a consumer holds: shared by its handles, its stream and its claim loop. `Own` is what
/// its broker keeps of it besides (its name there, its limits).
pub struct Holder<Id, Own> {
    pub queue: String,
    /// The most deliveries it holds unsettled.
    prefetch: usize,
    /// Ids delivered and not yet settled; changed under this lock together with `live`.
    unsettled: Mutex<BTreeSet<Id>>,
    /// Body bytes sent to the stream and not yet read from it.
    unread: Arc<AtomicU64>,
    /// Poked by a settlement, and by a read of the stream that brings `unread` under
    /// [`CLAIM_BYTES`]: there may be room for more.
    room: Arc<Notify>,
    cancelled: CancellationToken,
    closed: CancellationToken,
    /// Until it closes: its deliveries may be settled.
    pub live: Arc<AtomicBool>,
    /// Cancelled when every handle to it is gone: its claim loop ends.
    dropped: CancellationToken,
    pub own: Own,
}

impl<Id, Own> Drop for Holder<Id, Own> {
    fn drop(&mut self) {
        self.dropped.cancel();
    }
}

impl<Id: Ord + Clone, Own> Holder<Id, Own> {
    /// A consumer of `queue` holding at most `prefetch` unsettled (0: no limit).
    pub fn new(queue: &str, prefetch: u16, own: Own) -> Holder<Id, Own> {
        Holder {
            queue: queue.into(),
            // AMQP's prefetch 0 is no limit.
            prefetch: usize::from(if prefetch == 0 { u16::MAX } else { prefetch }),
            unsettled: Mutex::new(BTreeSet::new()),
            unread: Arc::new(AtomicU64::new(0)),
            room: Arc::new(Notify::new()),
            cancelled: CancellationToken::new(),
            closed: CancellationToken::new(),
            live: Arc::new(AtomicBool::new(true)),
            dropped: CancellationToken::new(),
            own,
        }
    }

    /// Whether it is still open.
    pub fn is_live(&self) -> bool {
        self.live.load(Ordering::SeqCst)
    }

    /// Fails once it is closed: what an ack or a settlement checks first.
    pub fn still_open(&self) -> Result<(), BrokerError> {
        match self.is_live() {
            true => Ok(()),
            false => Err(BrokerError::Lost("consumer closed".into())),
        }
    }

    /// The ids it holds unsettled (to renew their leases).
    pub fn held(&self) -> Vec<Id> {
        lock(&self.unsettled).iter().cloned().collect()
    }

    /// Forgets deliveries settled (acked, or moved with their copy): there may be room for more.
    pub fn settled<'a, Q>(&self, ids: impl IntoIterator<Item = &'a Q>)
    where
        Id: Borrow<Q>,
        Q: Ord + ?Sized + 'a,
    {
        let mut unsettled = lock(&self.unsettled);
        for id in ids {
            unsettled.remove(id);
        }
        drop(unsettled);
        self.room.notify_one();
    }

    /// It claims no more; its loop ends once it holds nothing.
    pub fn cancel(&self) {
        self.cancelled.cancel();
        self.room.notify_one();
    }

    /// Closes it: its deliveries can no longer be settled. The ids it held, for the broker to
    /// hand back.
    pub fn close(&self) -> Vec<Id> {
        let held = {
            let mut unsettled = lock(&self.unsettled);
            self.live.store(false, Ordering::SeqCst);
            std::mem::take(&mut *unsettled).into_iter().collect()
        };
        self.cancelled.cancel();
        self.closed.cancel();
        held
    }

    /// Whether it closed.
    pub fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    /// How many a claim may take now: what the prefetch leaves, none while its stream holds
    /// [`CLAIM_BYTES`] unread.
    fn room(&self) -> usize {
        if self.unread.load(Ordering::SeqCst) >= CLAIM_BYTES {
            return 0;
        }
        self.prefetch.saturating_sub(lock(&self.unsettled).len()).min(CLAIM_MAX)
    }
}

/// What a claim is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    /// How many it may take (at most [`CLAIM_MAX`]; 0 when the consumer holds all it may or
    /// delivers no more).
    pub room: usize,
    /// Whether the consumer still delivers (not cancelled, its stream not failed).
    pub delivering: bool,
}

/// What a claim took.
pub struct Claimed<Tag> {
    pub deliveries: Vec<Kept<Tag>>,
    /// It took all it was allowed (more may be ready): claim again at once.
    pub more: bool,
    /// Claim again after this at the latest, woken or not (`None`: only when woken).
    pub within: Option<Duration>,
    /// A failure that ends the consumer's stream with it. The loop goes on while the consumer
    /// holds deliveries (a broker that renews in its claims keeps renewing them).
    pub failed: Option<BrokerError>,
}

impl<Tag> Default for Claimed<Tag> {
    fn default() -> Self {
        Claimed { deliveries: Vec::new(), more: false, within: None, failed: None }
    }
}

impl<Tag> Claimed<Tag> {
    /// A claim that failed, ending the stream with `error`.
    pub fn failed(error: BrokerError) -> Claimed<Tag> {
        Claimed { failed: Some(error), ..Claimed::default() }
    }
}

/// The holder of a claim loop's consumer.
pub type HolderOf<C> = Holder<<C as Claimer>::Id, <C as Claimer>::Own>;

/// How a broker claims for one consumer: what the loop asks of a new broker.
pub trait Claimer: Send + 'static {
    /// A delivery's id in the broker (a row, a stream entry).
    type Id: Ord + Clone + Send + Sync + 'static;
    /// What the broker keeps of a delivery ([`Kept::tag`]).
    type Tag: Send + Sync + 'static;
    /// What the broker keeps of a consumer ([`Holder::own`]).
    type Own: Send + Sync + 'static;

    /// A delivery's id.
    fn id(tag: &Self::Tag) -> Self::Id;

    /// What pokes the consumer when its queue may hold more (a write, a copy come due).
    fn wake(&self) -> Arc<Notify>;

    /// Takes up to `ask.room` ready messages for the consumer, leased to it, in queue order,
    /// built with the holder's `live`. Called after every wake-up, with room or not (a broker
    /// that renews or registers in its claims does so then).
    fn claim(&mut self, holder: &HolderOf<Self>, ask: Ask) -> impl Future<Output = Claimed<Self::Tag>> + Send;

    /// Gives back what a claim took after the consumer closed, to be delivered first.
    fn hand_back(&mut self, holder: &HolderOf<Self>, ids: Vec<Self::Id>) -> impl Future<Output = ()> + Send;

    /// The consumer delivers no more (cancelled, or its stream failed), though it may hold
    /// deliveries still: it may stop counting as one. Called again each time round.
    fn retire(&mut self, _holder: &HolderOf<Self>) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// The loop ends: the consumer closed, or was cancelled and holds nothing. Whatever a
    /// claim on its way at the close took is the broker's to give back.
    fn end(&mut self, holder: &HolderOf<Self>) -> impl Future<Output = ()> + Send;
}

/// Starts the claim loop of `holder`'s consumer; its deliveries.
pub fn start<C: Claimer>(claimer: C, holder: &Arc<HolderOf<C>>) -> KeptDeliveries<C::Tag> {
    let (sender, receiver) = mpsc::unbounded_channel();
    tokio::spawn(run(claimer, Arc::downgrade(holder), sender));
    KeptDeliveries { receiver, unread: holder.unread.clone(), room: holder.room.clone() }
}

type Sender<Tag> = mpsc::UnboundedSender<Result<Kept<Tag>, BrokerError>>;

/// Claims when woken (by the broker, a settlement, a read that makes room, a cancel) or when
/// the last claim said; ends when the consumer closes, when it is cancelled holding nothing,
/// or when every handle to it is gone without a close.
async fn run<C: Claimer>(mut claimer: C, holder: Weak<HolderOf<C>>, sender: Sender<C::Tag>) {
    let wake = claimer.wake();
    let mut sender = Some(sender);
    loop {
        let Some(h) = holder.upgrade() else { return };
        if h.closed.is_cancelled() {
            return;
        }
        let woken = wake.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let delivering = sender.is_some() && !h.cancelled.is_cancelled();
        let room = if delivering { h.room() } else { 0 };
        let Claimed { deliveries, more, within, failed } = claimer.claim(&h, Ask { room, delivering }).await;
        if let Some(e) = failed
            && let Some(out) = sender.take()
        {
            let _ = out.send(Err(e));
        }
        if let Some(out) = &sender {
            deliver(&mut claimer, &h, out, deliveries).await;
        }
        if h.closed.is_cancelled() {
            claimer.end(&h).await;
            return;
        }
        if h.cancelled.is_cancelled() {
            sender = None;
            if lock(&h.unsettled).is_empty() {
                claimer.end(&h).await;
                return;
            }
        }
        if sender.is_none() {
            claimer.retire(&h).await;
        }
        if more {
            continue;
        }
        // Waits without holding the consumer, so that dropping every handle drops it.
        let (closed, dropped, cancelled, room) =
            (h.closed.clone(), h.dropped.clone(), h.cancelled.clone(), h.room.clone());
        drop(h);
        let timer = async {
            match within {
                Some(wait) => tokio::time::sleep(wait).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = closed.cancelled() => return,
            () = dropped.cancelled() => return,
            () = cancelled.cancelled(), if sender.is_some() => {}
            () = &mut woken => {}
            () = room.notified() => {}
            () = timer => {}
        }
    }
}

/// Hands claimed deliveries to the stream, or back to the broker if the consumer closed
/// meanwhile.
async fn deliver<C: Claimer>(claimer: &mut C, h: &HolderOf<C>, out: &Sender<C::Tag>, deliveries: Vec<Kept<C::Tag>>) {
    if deliveries.is_empty() {
        return;
    }
    let late = {
        let mut unsettled = lock(&h.unsettled);
        if h.live.load(Ordering::SeqCst) {
            for delivery in deliveries {
                unsettled.insert(C::id(&delivery.tag));
                let bytes = delivery.body.len() as u64;
                if out.send(Ok(delivery)).is_ok() {
                    h.unread.fetch_add(bytes, Ordering::SeqCst);
                }
            }
            return;
        }
        deliveries.iter().map(|d| C::id(&d.tag)).collect()
    };
    claimer.hand_back(h, late).await;
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use futures_util::StreamExt as _;
    use tokio::time::{Instant, timeout};

    use super::*;
    use crate::broker::Properties;

    /// Longer than anything here waits: under paused time, a call that never comes.
    const NEVER: Duration = Duration::from_secs(3600);

    /// A claim's answer: these ids, each with a body of `bytes`.
    struct Answer {
        ids: Vec<u64>,
        bytes: usize,
        more: bool,
        within: Option<Duration>,
    }

    fn took(ids: &[u64]) -> Result<Answer, BrokerError> {
        Ok(Answer { ids: ids.to_vec(), bytes: 1, more: false, within: None })
    }

    /// What the loop asked of the broker.
    #[derive(Debug, PartialEq, Eq)]
    enum Call {
        Claim { room: usize, delivering: bool },
        HandBack(Vec<u64>),
        Retire,
        End,
    }

    /// A broker whose every claim the test answers.
    struct Script {
        calls: mpsc::UnboundedSender<Call>,
        answers: mpsc::UnboundedReceiver<Result<Answer, BrokerError>>,
        wake: Arc<Notify>,
    }

    impl Claimer for Script {
        type Id = u64;
        type Tag = u64;
        type Own = ();

        fn id(tag: &u64) -> u64 {
            *tag
        }

        fn wake(&self) -> Arc<Notify> {
            self.wake.clone()
        }

        async fn claim(&mut self, h: &HolderOf<Self>, ask: Ask) -> Claimed<u64> {
            let _ = self.calls.send(Call::Claim { room: ask.room, delivering: ask.delivering });
            let answer = match self.answers.recv().await {
                Some(Ok(answer)) => answer,
                Some(Err(e)) => return Claimed::failed(e),
                None => return Claimed::default(),
            };
            let Answer { ids, bytes, more, within } = answer;
            let body = Bytes::from(vec![0; bytes]);
            let kept = |id| Kept::whole(id, body.clone(), Properties::default(), h.live.clone());
            Claimed { deliveries: ids.into_iter().map(kept).collect(), more, within, failed: None }
        }

        async fn hand_back(&mut self, _: &HolderOf<Self>, ids: Vec<u64>) {
            let _ = self.calls.send(Call::HandBack(ids));
        }

        async fn retire(&mut self, _: &HolderOf<Self>) {
            let _ = self.calls.send(Call::Retire);
        }

        async fn end(&mut self, _: &HolderOf<Self>) {
            let _ = self.calls.send(Call::End);
        }
    }

    struct Rig {
        holder: Arc<Holder<u64, ()>>,
        deliveries: KeptDeliveries<u64>,
        calls: mpsc::UnboundedReceiver<Call>,
        answers: mpsc::UnboundedSender<Result<Answer, BrokerError>>,
        wake: Arc<Notify>,
    }

    fn rig(prefetch: u16) -> Rig {
        let (calls_to, calls) = mpsc::unbounded_channel();
        let (answers, answers_from) = mpsc::unbounded_channel();
        let wake = Arc::new(Notify::new());
        let holder = Arc::new(Holder::new("q", prefetch, ()));
        let script = Script { calls: calls_to, answers: answers_from, wake: wake.clone() };
        let deliveries = start(script, &holder);
        Rig { holder, deliveries, calls, answers, wake }
    }

    impl Rig {
        /// The loop's next call; `None` when it makes none (waiting, or ended).
        async fn next(&mut self) -> Option<Call> {
            timeout(NEVER, self.calls.recv()).await.ok().flatten()
        }

        fn answer(&self, answer: Result<Answer, BrokerError>) {
            assert!(self.answers.send(answer).is_ok(), "the loop ended");
        }

        /// The ids its stream gives now, without waiting.
        async fn read(&mut self, n: usize) -> Vec<u64> {
            let mut ids = Vec::new();
            for _ in 0..n {
                match timeout(NEVER, self.deliveries.next()).await {
                    Ok(Some(Ok(d))) => ids.push(d.tag),
                    other => panic!("no delivery: {:?}", other.map(|o| o.map(|r| r.map(|d| d.tag)))),
                }
            }
            ids
        }
    }

    fn claim(room: usize) -> Option<Call> {
        Some(Call::Claim { room, delivering: true })
    }

    #[tokio::test(start_paused = true)]
    async fn claims_what_the_prefetch_leaves_when_woken_settled_or_told_there_is_more() {
        let mut r = rig(3);
        assert_eq!(r.next().await, claim(3));
        r.answer(took(&[1, 2]));
        assert_eq!(r.read(2).await, [1, 2]);
        assert_eq!(r.next().await, None, "idle: no claim until woken");
        r.wake.notify_waiters();
        assert_eq!(r.next().await, claim(1));
        r.answer(took(&[]));
        r.holder.settled(&[1]);
        assert_eq!(r.next().await, claim(2));
        r.answer(Ok(Answer { ids: vec![3, 4], bytes: 1, more: true, within: None }));
        assert_eq!(r.next().await, claim(0), "took all it was allowed: at once again");
        r.answer(took(&[]));
        assert_eq!(r.read(2).await, [3, 4]);
        assert_eq!(r.holder.held(), [2, 3, 4]);
        assert_eq!(r.next().await, None);
    }

    /// Large messages are claimed a few at a time: a stream holding `CLAIM_BYTES` unread
    /// claims nothing until a read makes room.
    #[tokio::test(start_paused = true)]
    async fn a_stream_full_of_unread_bytes_claims_nothing_until_read() {
        let mut r = rig(100);
        assert_eq!(r.next().await, claim(100));
        let half = usize::try_from(CLAIM_BYTES / 2).unwrap_or(usize::MAX);
        r.answer(Ok(Answer { ids: vec![1, 2], bytes: half, more: false, within: None }));
        assert_eq!(r.next().await, None);
        r.wake.notify_waiters();
        assert_eq!(r.next().await, claim(0), "full of unread bodies");
        r.answer(took(&[]));
        assert_eq!(r.read(1).await, [1]);
        assert_eq!(r.next().await, claim(98), "a read that makes room wakes it");
    }

    #[tokio::test(start_paused = true)]
    async fn claims_again_within_the_time_the_broker_says() {
        let mut r = rig(10);
        assert_eq!(r.next().await, claim(10));
        let asked = Instant::now();
        r.answer(Ok(Answer { ids: vec![], bytes: 0, more: false, within: Some(Duration::from_secs(1)) }));
        assert_eq!(r.next().await, claim(10));
        assert_eq!(asked.elapsed(), Duration::from_secs(1));
    }

    /// What a claim on its way at the close took goes back, never to the stream.
    #[tokio::test(start_paused = true)]
    async fn a_claim_answered_after_the_close_is_handed_back() {
        let mut r = rig(10);
        assert_eq!(r.next().await, claim(10));
        r.answer(took(&[1]));
        assert_eq!(r.read(1).await, [1]);
        r.wake.notify_waiters();
        assert_eq!(r.next().await, claim(9));
        assert_eq!(r.holder.close(), [1]);
        r.answer(took(&[2, 3]));
        assert_eq!(r.next().await, Some(Call::HandBack(vec![2, 3])));
        assert_eq!(r.next().await, Some(Call::End));
        assert_eq!(r.next().await, None, "ended");
        assert!(r.deliveries.next().await.is_none(), "nothing delivered after the close");
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_consumer_delivers_no_more_and_ends_once_it_holds_nothing() {
        let mut r = rig(10);
        assert_eq!(r.next().await, claim(10));
        r.answer(took(&[1]));
        assert_eq!(r.read(1).await, [1]);
        r.holder.cancel();
        assert_eq!(r.next().await, Some(Call::Claim { room: 0, delivering: false }));
        r.answer(took(&[]));
        assert_eq!(r.next().await, Some(Call::Retire), "it holds 1 still");
        assert!(r.deliveries.next().await.is_none(), "its stream ends");
        r.holder.settled(&[1]);
        assert_eq!(r.next().await, Some(Call::Claim { room: 0, delivering: false }));
        r.answer(took(&[]));
        assert_eq!(r.next().await, Some(Call::End));
        assert_eq!(r.next().await, None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_claim_ends_the_stream_with_its_error() {
        let mut r = rig(10);
        assert_eq!(r.next().await, claim(10));
        r.answer(Err(BrokerError::Lost("gone".into())));
        assert!(matches!(r.deliveries.next().await, Some(Err(BrokerError::Lost(_)))));
        assert!(r.deliveries.next().await.is_none());
        assert_eq!(r.next().await, Some(Call::Retire), "it no longer counts as a consumer");
    }

    /// Every handle gone without a close: the loop ends, handing nothing back (its leases run
    /// out, as a killed process's do).
    #[tokio::test(start_paused = true)]
    async fn the_loop_ends_when_every_handle_is_gone() {
        let mut r = rig(10);
        assert_eq!(r.next().await, claim(10));
        r.answer(took(&[1]));
        assert_eq!(r.read(1).await, [1]);
        drop(r.holder);
        assert_eq!(timeout(NEVER, r.calls.recv()).await.ok(), Some(None), "ended without a call");
    }
}
