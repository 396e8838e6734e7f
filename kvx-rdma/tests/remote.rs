//! kvx-rdma acceptance tests over real sockets, with the producer in a separate process.
//!
//! Every test whose name the issue lists is here; `partition_netns` needs `ip netns` (root) and
//! prints a skip line where that is not permitted.

mod remote {
    pub mod bad_peer;
    pub mod faults;
    pub mod lease;
    pub mod netns;
    pub mod peer;
    pub mod slow_reader;
    pub mod timing;
}

use libtest_mimic::{Arguments, Failed, Trial};

fn trial(name: &'static str, f: fn()) -> Trial {
    Trial::test(name, move || {
        std::panic::catch_unwind(f).map_err(|e| {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panicked".into());
            Failed::from(msg)
        })
    })
}

fn main() {
    if let Ok(role) = std::env::var("KVX_RDMA_ROLE") {
        let code = match role.as_str() {
            "producer" => remote::peer::producer(),
            "consumer" => remote::peer::consumer(),
            other => {
                eprintln!("unknown KVX_RDMA_ROLE {other}");
                2
            }
        };
        std::process::exit(code);
    }
    let args = Arguments::from_args();
    use remote::{bad_peer, faults, lease, slow_reader};
    let mut trials = vec![
        trial(
            "lease_expires_without_reader_real_time",
            lease::lease_expires_without_reader_real_time,
        ),
        trial("heartbeat_keeps_lease", lease::heartbeat_keeps_lease),
        trial("read_after_expiry_fails", lease::read_after_expiry_fails),
        trial("tp_ratio_readers", lease::tp_ratio_readers),
        trial(
            "slow_reader_cut_at_lease_end",
            slow_reader::slow_reader_cut_at_lease_end,
        ),
        trial(
            "slow_reader_cut_at_abort",
            slow_reader::slow_reader_cut_at_abort,
        ),
        trial(
            "slow_reader_cut_at_write_timeout",
            slow_reader::slow_reader_cut_at_write_timeout,
        ),
        trial("producer_killed_mid_read", faults::producer_killed_mid_read),
        trial("stalled_producer", faults::stalled_producer),
        trial("bad_peer_input", bad_peer::bad_peer_input),
        trial(
            "bad_peer_input_from_server",
            bad_peer::bad_peer_input_from_server,
        ),
        trial(
            "surplus_reply_is_not_pooled",
            bad_peer::surplus_reply_is_not_pooled,
        ),
        trial(
            "a_pooled_connection_the_producer_closed_is_not_used",
            bad_peer::a_pooled_connection_the_producer_closed_is_not_used,
        ),
        trial(
            "a_pooled_connection_closed_as_the_reads_go_out_is_replaced_once",
            bad_peer::a_pooled_connection_closed_as_the_reads_go_out_is_replaced_once,
        ),
    ];
    let netns = remote::netns::available();
    if let Err(reason) = &netns {
        println!("skip: partition_netns: ip netns is not permitted here: {reason}");
    }
    trials
        .push(trial("partition_netns", faults::partition_netns).with_ignored_flag(netns.is_err()));
    libtest_mimic::run(&args, trials).exit();
}
