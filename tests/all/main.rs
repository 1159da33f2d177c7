//! allocbox's integration tests: one binary, a module per area (keeps link time down).

mod support;

mod bad_input;
mod bad_traces;
mod chain;
mod chaos;
mod check;
mod client;
mod compile_cache;
mod contract;
mod counted;
mod coverage;
mod fuzz;
mod gpu;
mod hostile;
mod kinds;
mod languages;
mod limits;
mod load;
mod nep49;
mod new_policy;
mod observe;
mod outputs;
mod pool;
mod report;
mod report_page;
mod shards;
mod threads;
mod trace;
mod wasi;

mod smith;

mod smoke {
    use super::support::*;

    #[test]
    fn every_good_policy_serves_a_malloc_free_round_trip() {
        for guest in allocbox_artifacts::GOOD {
            let h = handler(guest, &[]);
            let p = h.malloc(100).unwrap().unwrap();
            fill(p, 100, 0x5a);
            assert!(holds(p, 100, 0x5a));
            h.free(Some(p), 100).unwrap();
            h.trim().unwrap();
            assert_eq!(h.held_from_host().unwrap(), (0, 0), "{} leaks", guest.name);
        }
    }
}
