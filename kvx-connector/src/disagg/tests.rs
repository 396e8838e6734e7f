use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

const BT: u64 = 16;
const NS: &str = "ns-of-this-engine";
const DEADLINE: Duration = Duration::from_millis(300);

/// Leases whose answers the test sets; every keep and release recorded.
#[derive(Default)]
struct Fake {
    answers: HashMap<RequestId, Lease>,
    kept: Vec<RequestId>,
    released: Vec<(RequestId, bool)>,
}

impl Leases for Fake {
    fn keep(&mut self, number: RequestId, _: &RemoteSource) -> Result<(), String> {
        self.kept.push(number);
        self.answers.entry(number).or_insert(Lease::Pending);
        Ok(())
    }

    fn status(&self, number: RequestId) -> Option<Lease> {
        self.kept
            .contains(&number)
            .then(|| self.answers[&number].clone())
    }

    fn release(&mut self, number: RequestId, done: bool) {
        self.released.push((number, done));
    }
}

fn key(i: u64) -> BlockKey {
    BlockKey::chain(None, &i.to_be_bytes())
}

fn keys(n: u64) -> Vec<BlockKey> {
    (0..n).map(key).collect()
}

fn source(namespace: &str, producers: usize, blocks: u64) -> String {
    RemoteSource {
        namespace: namespace.into(),
        export: 7,
        producers: (0..producers)
            .map(|i| format!("127.0.0.1:{}", 4000 + i).parse().unwrap())
            .collect(),
        keys: keys(blocks),
        ttl_ms: 10_000,
        heartbeat_ms: 1000,
    }
    .to_json()
}

fn consumer() -> Consumer {
    Consumer::new(NS.into(), 1, BT, DEADLINE)
}

#[test]
fn a_source_that_does_not_fit_this_engine_computes_here_and_keeps_no_lease() {
    let now = Instant::now();
    let cases = [
        (source("other", 1, 4), "namespace other"),
        (source(NS, 2, 4), "2 producer ranks"),
        ("{\"namespace\": 1}".to_string(), "kv_transfer_params.kvx"),
        ("null".to_string(), "kv_transfer_params.kvx"),
        ("{\"export\": 1}".to_string(), "missing field"),
    ];
    for (text, want) in cases {
        let (mut c, mut l) = (consumer(), Fake::default());
        let got = c.lookup(&mut l, "r", RequestId(1), Some(&text), &keys(4), 0, now);
        let Lookup::Compute { why: Some(why) } = got else {
            panic!("{got:?}");
        };
        assert!(why.contains(want), "{why}");
        assert!(c.knows("r") && !c.is_remote("r"));
        assert!(l.kept.is_empty() && l.released.is_empty());
        // From now on the request is an ordinary one.
        assert_eq!(
            c.lookup(&mut l, "r", RequestId(1), Some(&text), &keys(4), 0, now),
            Lookup::Local
        );
        c.finished(&mut l, "r");
        assert_eq!(c.counts(), (0, 1));
        assert!(l.released.is_empty());
    }
    let (mut c, mut l) = (consumer(), Fake::default());
    let other_prompt: Vec<BlockKey> = (10..14).map(key).collect();
    let got = c.lookup(
        &mut l,
        "r",
        RequestId(1),
        Some(&source(NS, 1, 4)),
        &other_prompt,
        0,
        now,
    );
    assert!(
        matches!(got, Lookup::Compute { why: Some(w) } if w.contains("not this request's prompt"))
    );
}

#[test]
fn a_lease_never_confirmed_is_waited_for_one_deadline_then_given_up() {
    let t0 = Instant::now();
    let (mut c, mut l) = (consumer(), Fake::default());
    let s = source(NS, 1, 4);
    let look = |c: &mut Consumer, l: &mut Fake, at: Duration| {
        c.lookup(l, "r", RequestId(3), Some(&s), &keys(4), 0, t0 + at)
    };
    assert_eq!(look(&mut c, &mut l, Duration::ZERO), Lookup::Wait);
    assert_eq!(
        look(&mut c, &mut l, DEADLINE - Duration::from_millis(1)),
        Lookup::Wait
    );
    let got = look(&mut c, &mut l, DEADLINE);
    assert!(
        matches!(&got, Lookup::Compute { why: Some(w) } if w.contains("within 300 ms")),
        "{got:?}"
    );
    assert_eq!(
        l.released,
        [(RequestId(3), false)],
        "not done: the producer keeps its TTL"
    );
    assert_eq!(look(&mut c, &mut l, DEADLINE * 2), Lookup::Local);
    c.finished(&mut l, "r");
    assert_eq!(l.released.len(), 1, "released once");
}

#[test]
fn a_confirmed_lease_offers_the_blocks_beyond_the_local_prefix_and_plans_their_load() {
    let now = Instant::now();
    let (mut c, mut l) = (consumer(), Fake::default());
    let s = source(NS, 1, 4);
    assert_eq!(
        c.lookup(&mut l, "r", RequestId(5), Some(&s), &keys(5), 0, now),
        Lookup::Wait
    );
    l.answers.insert(RequestId(5), Lease::Live);
    // One block computed here: the other three are offered.
    assert_eq!(
        c.lookup(&mut l, "r", RequestId(5), Some(&s), &keys(5), BT, now),
        Lookup::Offer(3 * BT)
    );
    assert_eq!(
        c.allocated(&mut l, "q", &[1, 2, 3, 4], 3 * BT),
        Allocated::Local
    );
    let Allocated::Load { number, blocks, .. } =
        c.allocated(&mut l, "r", &[9, 10, 11, 12, 13], 3 * BT)
    else {
        panic!("a load is planned");
    };
    assert_eq!(number, RequestId(5));
    assert_eq!(
        blocks,
        [
            (1, EngineBlockId(10)),
            (2, EngineBlockId(11)),
            (3, EngineBlockId(12))
        ]
    );
    assert!(c.is_remote("r"));
    assert_eq!(
        c.lookup(&mut l, "r", RequestId(5), Some(&s), &keys(5), BT, now),
        Lookup::Compute { why: None },
        "a lookup while loading offers nothing more"
    );
    assert!(
        l.released.is_empty(),
        "the lease is kept while the load runs"
    );
    c.loaded(&mut l, "r");
    assert_eq!(l.released, [(RequestId(5), true)]);
    assert!(!c.is_remote("r"));
    c.finished(&mut l, "r");
    assert_eq!(l.released.len(), 1);
    assert_eq!(c.counts(), (0, 0));
}

#[test]
fn a_full_local_hit_or_nothing_allocated_lets_the_producer_go_at_once() {
    let now = Instant::now();
    let s = source(NS, 1, 2);
    let (mut c, mut l) = (consumer(), Fake::default());
    l.answers.insert(RequestId(1), Lease::Live);
    assert_eq!(
        c.lookup(&mut l, "r", RequestId(1), Some(&s), &keys(2), 2 * BT, now),
        Lookup::Compute { why: None }
    );
    assert_eq!(l.released, [(RequestId(1), true)]);
    let (mut c, mut l) = (consumer(), Fake::default());
    l.answers.insert(RequestId(1), Lease::Live);
    assert_eq!(
        c.lookup(&mut l, "r", RequestId(1), Some(&s), &keys(2), 0, now),
        Lookup::Offer(2 * BT)
    );
    assert_eq!(
        c.allocated(&mut l, "r", &[], 0),
        Allocated::Ended { why: None }
    );
    assert_eq!(l.released, [(RequestId(1), true)]);
}

#[test]
fn a_lost_lease_or_a_plan_beyond_the_source_computes_here() {
    let now = Instant::now();
    let s = source(NS, 1, 2);
    let (mut c, mut l) = (consumer(), Fake::default());
    l.answers
        .insert(RequestId(1), Lease::Lost("export gone".into()));
    let got = c.lookup(&mut l, "r", RequestId(1), Some(&s), &keys(2), 0, now);
    assert!(
        matches!(&got, Lookup::Compute { why: Some(w) } if w.contains("export gone")),
        "{got:?}"
    );
    assert_eq!(l.released, [(RequestId(1), false)]);
    let (mut c, mut l) = (consumer(), Fake::default());
    l.answers.insert(RequestId(1), Lease::Live);
    assert_eq!(
        c.lookup(&mut l, "r", RequestId(1), Some(&s), &keys(2), 0, now),
        Lookup::Offer(2 * BT)
    );
    let got = c.allocated(&mut l, "r", &[4], 2 * BT);
    assert!(
        matches!(&got, Allocated::Ended { why: Some(w) } if w.contains("1 allocated")),
        "{got:?}"
    );
    assert_eq!(l.released, [(RequestId(1), false)]);
}

#[derive(Debug, Clone)]
enum Call {
    Lookup(usize, u64, Option<Lease>),
    Alloc(usize, u64),
    Loaded(usize),
    Finished(usize),
    Later(u64),
}

fn lease() -> impl Strategy<Value = Option<Lease>> {
    prop_oneof![
        Just(None),
        Just(Some(Lease::Pending)),
        Just(Some(Lease::Live)),
        Just(Some(Lease::Lost("refused".into()))),
    ]
}

fn call() -> impl Strategy<Value = Call> {
    prop_oneof![
        (0usize..3, 0u64..5, lease()).prop_map(|(r, c, l)| Call::Lookup(r, c, l)),
        (0usize..3, 0u64..5).prop_map(|(r, n)| Call::Alloc(r, n)),
        (0usize..3).prop_map(Call::Loaded),
        (0usize..3).prop_map(Call::Finished),
        (0u64..400).prop_map(Call::Later),
    ]
}

proptest! {
    /// Whatever the engine's calls and the producers' answers: a lease is kept only for a
    /// source that fits, released at most once while the request lives, always once it
    /// finished, with `done` false only when the producer's blocks were not used; an offer
    /// never goes beyond the source; nothing is left once every request finished.
    #[test]
    fn every_kept_lease_is_released_exactly_once(calls in proptest::collection::vec(call(), 1..50)) {
        let names = ["a", "b", "c"];
        let s = source(NS, 1, 4);
        let (mut c, mut l) = (consumer(), Fake::default());
        let mut now = Instant::now();
        // The engine never asks about a request again once it finished it.
        let mut gone = [false; 3];
        for call in calls {
            let r = match &call {
                Call::Lookup(r, ..) | Call::Alloc(r, _) | Call::Loaded(r) | Call::Finished(r) => Some(*r),
                Call::Later(_) => None,
            };
            if r.is_some_and(|r| gone[r]) {
                continue;
            }
            match call {
                Call::Lookup(r, computed, answer) => {
                    let number = RequestId(r as u64 + 1);
                    if let Some(a) = answer.filter(|_| l.kept.contains(&number)) {
                        l.answers.insert(number, a);
                    }
                    let got = c.lookup(&mut l, names[r], number, Some(&s), &keys(4), computed * BT, now);
                    if let Lookup::Offer(t) = got {
                        prop_assert!(t > 0 && t + computed * BT <= 4 * BT);
                    }
                }
                Call::Alloc(r, blocks) => {
                    let table: Vec<u32> = (0..8).collect();
                    if let Allocated::Load { blocks: b, .. } = c.allocated(&mut l, names[r], &table, blocks * BT) {
                        prop_assert!(!b.is_empty() && b.iter().all(|(i, _)| *i < 4));
                    }
                }
                Call::Loaded(r) => c.loaded(&mut l, names[r]),
                Call::Finished(r) => {
                    c.finished(&mut l, names[r]);
                    gone[r] = true;
                }
                Call::Later(ms) => now += Duration::from_millis(ms),
            }
            for (n, _) in &l.released {
                prop_assert!(l.kept.contains(n), "released a lease never kept");
                prop_assert_eq!(l.released.iter().filter(|(m, _)| m == n).count(), 1);
            }
            prop_assert_eq!(l.kept.iter().collect::<std::collections::HashSet<_>>().len(), l.kept.len());
        }
        for n in names {
            c.finished(&mut l, n);
        }
        prop_assert_eq!(c.counts().0, 0);
        let mut kept = l.kept.clone();
        let mut released: Vec<RequestId> = l.released.iter().map(|(n, _)| *n).collect();
        kept.sort();
        released.sort();
        prop_assert_eq!(kept, released);
    }
}
