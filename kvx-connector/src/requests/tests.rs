//! The request table against a model of the engine's calls and the workers' reports.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

#[test]
fn a_request_finished_while_loading_is_abandoned_and_goes_at_its_load_report() {
    let mut t = Requests::new();
    let a = t.admit("a");
    assert_eq!(a, RequestId(1));
    assert_eq!(t.admit("a"), a, "a live request keeps its number");
    t.set_matched(a, Matched::default());
    assert!(!t.load_started(a));
    assert!(t.is_loading("a"));
    assert_eq!(t.finish("a", true), Some((a, Ending::Abandoned)));
    assert_eq!(t.take_abandoned(), vec![a]);
    assert!(t.take_abandoned().is_empty(), "handed out once");
    assert_eq!(t.name(a), Some("a"), "still reported");
    t.send_reported("a");
    assert_eq!(t.numbers(), 1, "a finished_sending does not end a load");
    t.recv_reported("a");
    assert_eq!((t.counts(), t.numbers()), ((0, 0, 0), 0));
    assert_eq!(t.admit("a"), RequestId(2), "numbers are never reused");
}

#[test]
fn an_in_step_load_is_never_loading_and_a_cap_only_lowers() {
    let mut t = Requests::new();
    let a = t.admit("a");
    t.set_matched(
        a,
        Matched {
            in_step: true,
            ..Matched::default()
        },
    );
    assert!(t.load_started(a));
    assert!(!t.is_loading("a"));
    assert_eq!(t.take_in_step(), vec![a]);
    t.lower_cap(a, 5);
    t.lower_cap(a, 7);
    assert_eq!(t.cap(a), Some(5));
    assert_eq!(t.finish("a", false), Some((a, Ending::Freed)));
    assert_eq!(t.cap(a), None);
    assert_eq!(t.finish("a", false), None, "finished once");
}

#[derive(Debug, Clone)]
enum Call {
    Lookup(usize, bool),
    LoadStarted(usize),
    Finish(usize, bool),
    LoadEnds(usize),
    SendReport(usize),
    Step,
}

fn call() -> impl Strategy<Value = Call> {
    prop_oneof![
        (0..4usize, any::<bool>()).prop_map(|(n, s)| Call::Lookup(n, s)),
        (0..4usize).prop_map(Call::LoadStarted),
        (0..4usize, any::<bool>()).prop_map(|(n, d)| Call::Finish(n, d)),
        (0..4usize).prop_map(Call::LoadEnds),
        (0..4usize).prop_map(Call::SendReport),
        Just(Call::Step),
    ]
}

/// What the engine and its workers know of one request id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Model {
    Live {
        loading: bool,
        in_step: bool,
    },
    /// Finished; the engine waits for `finished_sending`.
    Delayed,
    /// Finished while loading; the engine waits for `finished_recving`.
    Abandoned,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Random engine calls and worker reports, each only where the engine would make it: the
    /// table agrees with the model at every call, hands each abandoned request out once, never
    /// reuses a number, and is empty once every request finished and every report arrived.
    #[test]
    fn the_table_follows_the_engine_and_leaks_nothing(calls in prop::collection::vec(call(), 0..80)) {
        let names = ["r0", "r1", "r2", "r3"];
        let mut t = Requests::new();
        let mut model: HashMap<usize, Model> = HashMap::new();
        let mut ids: HashMap<usize, RequestId> = HashMap::new();
        let mut seen = std::collections::HashSet::new();
        let mut abandoned_out: Vec<RequestId> = Vec::new();
        let mut abandoned_in: Vec<RequestId> = Vec::new();
        for c in calls {
            match c {
                Call::Lookup(n, in_step) => match model.get(&n) {
                    None => {
                        let id = t.admit(names[n]);
                        prop_assert!(seen.insert(id), "number {id:?} reused");
                        ids.insert(n, id);
                        t.set_matched(id, Matched { in_step, ..Matched::default() });
                        model.insert(n, Model::Live { loading: false, in_step });
                    }
                    Some(Model::Live { loading: false, .. }) => {
                        prop_assert_eq!(t.admit(names[n]), ids[&n]);
                        t.set_matched(ids[&n], Matched { in_step, ..Matched::default() });
                        model.insert(n, Model::Live { loading: false, in_step });
                    }
                    _ => {}
                },
                Call::LoadStarted(n) => {
                    if let Some(Model::Live { loading: false, in_step }) = model.get(&n).copied() {
                        prop_assert_eq!(t.load_started(ids[&n]), in_step);
                        model.insert(n, Model::Live { loading: !in_step, in_step });
                    }
                }
                Call::Finish(n, delayed) => {
                    if let Some(Model::Live { loading, .. }) = model.get(&n).copied() {
                        let (id, ending) = t.finish(names[n], delayed).unwrap();
                        prop_assert_eq!(id, ids[&n]);
                        let want = if loading {
                            Ending::Abandoned
                        } else if delayed {
                            Ending::Delayed
                        } else {
                            Ending::Freed
                        };
                        prop_assert_eq!(ending, want);
                        match ending {
                            Ending::Freed => { model.remove(&n); }
                            Ending::Delayed => { model.insert(n, Model::Delayed); }
                            Ending::Abandoned => {
                                abandoned_in.push(id);
                                model.insert(n, Model::Abandoned);
                            }
                        }
                    }
                }
                Call::LoadEnds(n) => match model.get(&n).copied() {
                    Some(Model::Live { loading: true, in_step }) => {
                        t.recv_reported(names[n]);
                        model.insert(n, Model::Live { loading: false, in_step });
                    }
                    Some(Model::Abandoned) => {
                        t.recv_reported(names[n]);
                        model.remove(&n);
                    }
                    _ => {}
                },
                Call::SendReport(n) => {
                    if model.get(&n) == Some(&Model::Delayed) {
                        t.send_reported(names[n]);
                        model.remove(&n);
                    }
                }
                Call::Step => {
                    abandoned_out.extend(t.take_abandoned());
                    t.take_in_step();
                }
            }
            for (n, m) in &model {
                prop_assert_eq!(t.is_loading(names[*n]), matches!(m, Model::Live { loading: true, .. } | Model::Abandoned));
                prop_assert_eq!(t.name(ids[n]), Some(names[*n]));
                prop_assert_eq!(t.live(names[*n]).is_some(), matches!(m, Model::Live { .. }));
            }
            prop_assert_eq!(t.numbers(), model.len());
        }
        abandoned_out.extend(t.take_abandoned());
        prop_assert_eq!(&abandoned_out, &abandoned_in, "each abandoned request handed out once, in order");
        // The engine finishes what is live, the workers report what is out: nothing is left.
        for (n, name) in names.iter().enumerate() {
            match model.get(&n).copied() {
                Some(Model::Live { loading, .. }) => {
                    let (_, ending) = t.finish(name, false).unwrap();
                    if loading {
                        prop_assert_eq!(ending, Ending::Abandoned);
                        t.recv_reported(name);
                    }
                }
                Some(Model::Delayed) => t.send_reported(name),
                Some(Model::Abandoned) => t.recv_reported(name),
                None => {}
            }
        }
        prop_assert_eq!((t.counts(), t.numbers()), ((0, 0, 0), 0));
    }
}
