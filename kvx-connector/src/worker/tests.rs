use proptest::prelude::*;

use super::*;

fn msg(step: u64, loads: &[u64], delayed: &[u64], abandoned: &[u64]) -> StepMsg {
    let ids = |v: &[u64]| v.iter().map(|r| RequestId(*r)).collect::<Vec<_>>();
    StepMsg {
        step,
        names: loads
            .iter()
            .chain(delayed)
            .map(|r| (RequestId(*r), format!("req-{r}")))
            .collect(),
        loads: ids(loads),
        delayed: ids(delayed),
        abandoned: ids(abandoned),
        ..StepMsg::default()
    }
}

fn released(recving: &[u64], failed: &[u64], ended: &[u64]) -> ReleasedLoads {
    let ids = |v: &[u64]| v.iter().map(|r| RequestId(*r)).collect::<Vec<_>>();
    ReleasedLoads {
        finished_recving: ids(recving),
        failed_recving: ids(failed),
        ended: ids(ended),
        ..ReleasedLoads::default()
    }
}

#[test]
fn a_step_handed_over_by_several_calls_starts_once() {
    let mut w = WorkerRequests::new();
    let m = msg(1, &[1], &[], &[]);
    assert!(w.start(&m));
    assert!(!w.start(&m), "the same step again");
    assert!(w.start(&msg(2, &[], &[], &[])));
    assert_eq!(w.counts(), [1, 1, 0, 0]);
}

#[test]
fn a_load_is_reported_once_by_the_engines_id_then_forgotten() {
    let mut w = WorkerRequests::new();
    w.start(&msg(1, &[1, 2], &[], &[]));
    let out = w.reported(&[], &released(&[1, 2], &[2], &[]));
    assert_eq!(out.finished_recving, ["req-1", "req-2"]);
    assert_eq!(out.failed_recving, ["req-2"]);
    assert_eq!(
        w.reported(&[], &released(&[1], &[], &[])),
        Reported::default(),
        "reported once"
    );
    assert_eq!(w.counts(), [0; 4]);
}

#[test]
fn a_request_loading_and_delayed_keeps_its_id_until_both_are_reported() {
    let mut w = WorkerRequests::new();
    w.start(&msg(1, &[7], &[7], &[]));
    assert_eq!(
        w.reported(&[], &released(&[7], &[], &[])).finished_recving,
        ["req-7"]
    );
    assert_eq!(w.counts(), [1, 0, 1, 0]);
    assert_eq!(
        w.reported(&[RequestId(7)], &released(&[], &[], &[]))
            .finished_sending,
        ["req-7"]
    );
    assert_eq!(w.counts(), [0; 4]);
}

#[test]
fn an_abandoned_load_is_reported_once_it_ended() {
    let mut w = WorkerRequests::new();
    w.start(&msg(1, &[3], &[], &[]));
    w.start(&msg(2, &[], &[], &[3, 9]));
    assert_eq!(w.counts(), [1, 1, 0, 1], "9 was never loading here");
    let out = w.reported(&[], &released(&[], &[], &[3, 9]));
    assert_eq!(out.finished_recving, ["req-3"]);
    assert_eq!(w.counts(), [0; 4]);
}

#[test]
fn a_load_that_ended_while_its_request_lives_waits_for_its_report() {
    let mut w = WorkerRequests::new();
    w.start(&msg(1, &[4], &[], &[]));
    assert_eq!(
        w.reported(&[], &released(&[], &[], &[4])),
        Reported::default(),
        "ended is the scheduler side's unless the request was abandoned"
    );
    assert_eq!(w.counts(), [1, 1, 0, 0]);
}

#[derive(Debug, Clone)]
enum Call {
    /// A new step: loads of the first set, delayed frees of the second, abandoned the third.
    Step(Vec<u64>, Vec<u64>, Vec<u64>),
    /// The same step handed over again.
    Again,
    Recv(u64, bool),
    Ended(u64),
    Send(u64),
}

fn call() -> impl Strategy<Value = Call> {
    let reqs = || proptest::collection::vec(0u64..6, 0..3);
    prop_oneof![
        (reqs(), reqs(), reqs()).prop_map(|(l, d, a)| Call::Step(l, d, a)),
        Just(Call::Again),
        (0u64..6, any::<bool>()).prop_map(|(r, f)| Call::Recv(r, f)),
        (0u64..6).prop_map(Call::Ended),
        (0u64..6).prop_map(Call::Send),
    ]
}

proptest! {
    /// Against a model of what was started and not yet reported: every report names a
    /// request a step started and not yet reported, by its engine id, failed only if its load
    /// failed; a step handed over twice changes nothing; once every load and delayed free was
    /// reported nothing is left.
    #[test]
    fn reports_follow_the_steps(calls in proptest::collection::vec(call(), 1..60)) {
        let mut w = WorkerRequests::new();
        let (mut loading, mut sending, mut abandoned) =
            (HashSet::new(), HashSet::new(), HashSet::new());
        let mut step = 0;
        let mut last = StepMsg::default();
        for c in calls {
            match c {
                Call::Step(l, d, a) => {
                    step += 1;
                    last = msg(step, &l, &d, &a);
                    prop_assert!(w.start(&last));
                    loading.extend(l);
                    sending.extend(d);
                    abandoned.extend(a.into_iter().filter(|r| loading.contains(r)));
                }
                Call::Again => {
                    let before = w.counts();
                    prop_assert!(!w.start(&last) || step == 0);
                    prop_assert_eq!(w.counts(), before);
                }
                Call::Recv(r, failed) => {
                    let fails: &[u64] = if failed { &[r] } else { &[] };
                    let out = w.reported(&[], &released(&[r], fails, &[]));
                    let expect: Vec<String> =
                        if loading.remove(&r) { vec![format!("req-{r}")] } else { vec![] };
                    abandoned.remove(&r);
                    prop_assert_eq!(&out.finished_recving, &expect);
                    prop_assert_eq!(out.failed_recving, if failed { expect } else { vec![] });
                }
                Call::Ended(r) => {
                    let out = w.reported(&[], &released(&[], &[], &[r]));
                    let was = abandoned.remove(&r);
                    if was {
                        loading.remove(&r);
                    }
                    prop_assert_eq!(out.finished_recving.len(), usize::from(was));
                }
                Call::Send(r) => {
                    let out = w.reported(&[RequestId(r)], &released(&[], &[], &[]));
                    let expect: Vec<String> =
                        if sending.remove(&r) { vec![format!("req-{r}")] } else { vec![] };
                    prop_assert_eq!(out.finished_sending, expect);
                }
            }
            let c = w.counts();
            prop_assert_eq!((c[1], c[2], c[3]), (loading.len(), sending.len(), abandoned.len()));
            prop_assert_eq!(c[0], loading.union(&sending).count());
        }
        let recv: Vec<RequestId> = loading.iter().map(|r| RequestId(*r)).collect();
        let send: Vec<RequestId> = sending.iter().map(|r| RequestId(*r)).collect();
        w.reported(&send, &ReleasedLoads { finished_recving: recv, ..ReleasedLoads::default() });
        prop_assert_eq!(w.counts(), [0; 4]);
    }
}
