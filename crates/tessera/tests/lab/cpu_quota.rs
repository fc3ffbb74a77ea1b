//! A lab host's CPU quota: it binds within milliseconds, and lifting it (as a cluster does
//! while its nodes probe their hosts) stops the throttling.

use std::time::Duration;

use crate::lab_or_skip;
use tessera_lab::{HostSpec, Lab, LabSpec};

/// CPU seconds process `pid` has used (user and system).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<u64> = after
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|x| x.parse().unwrap())
        .collect();
    (f[0] + f[1]) as f64 / 100.0 // USER_HZ
}

/// The periods the host's CPU cgroup has been throttled in (`cpu.stat`, v1 or v2).
fn throttled_periods(lab: &Lab) -> u64 {
    let dir = tessera_lab::cgroup::list(lab.id())
        .into_iter()
        .find(|d| d.join("cpu.stat").exists())
        .expect("the host's CPU cgroup");
    let stat = std::fs::read_to_string(dir.join("cpu.stat")).unwrap();
    stat.lines()
        .find_map(|l| l.strip_prefix("nr_throttled "))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// A busy loop on the lab's host for `wall`: the CPU it got over the wall time.
fn burn(lab: &Lab, wall: Duration) -> f64 {
    let mut child = lab
        .command(0, "sh")
        .unwrap()
        .args(["-c", "while :; do :; done"])
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    std::thread::sleep(wall);
    let used = cpu_seconds(child.id());
    let share = used / t.elapsed().as_secs_f64();
    child.kill().unwrap();
    child.wait().unwrap();
    share
}

/// A host's CPU quota binds within a tiny model's request (a burst of milliseconds, which a
/// 100 ms CFS period would let run unthrottled), and lifting it — as a cluster does while its
/// nodes probe their hosts — stops the throttling. Only upper bounds on CPU are asserted: a
/// busy machine gives the loop less, never more.
#[test]
fn a_hosts_cpu_quota_binds_within_milliseconds_and_lifts_while_nodes_probe() {
    let mut host = HostSpec::new("slow");
    host.limits.cpu_quota = Some(0.2);
    let Some(lab) = lab_or_skip(&LabSpec::new(vec![host])) else {
        return;
    };
    let before = throttled_periods(&lab);
    let share = burn(&lab, Duration::from_millis(40));
    let throttled = throttled_periods(&lab) - before;
    // 40 ms is eight of the 5 ms periods a fifth of a core gets.
    assert!(throttled >= 3, "throttled in {throttled} periods of 40 ms");
    let share_long = burn(&lab, Duration::from_millis(600));
    assert!(
        share_long < 0.35,
        "a fifth of a core's quota gave {share_long:.2} cores"
    );
    eprintln!("quota 0.2: {share:.2} cores over 40 ms, {share_long:.2} over 600 ms");

    lab.set_cpu_quotas(false).unwrap();
    let before = throttled_periods(&lab);
    burn(&lab, Duration::from_millis(200));
    assert_eq!(
        throttled_periods(&lab),
        before,
        "throttled with the quota lifted"
    );

    lab.set_cpu_quotas(true).unwrap();
    let before = throttled_periods(&lab);
    burn(&lab, Duration::from_millis(40));
    assert!(
        throttled_periods(&lab) > before,
        "not throttled once imposed again"
    );
}
