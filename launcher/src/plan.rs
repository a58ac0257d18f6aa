//! Hostfiles, stage two: raw entries (or a bare `--np`) -> a validated [`LaunchPlan`].
//!
//! A plan says, for every rank, where it runs: its global rank, its local rank, its node and host.
//! Invariants of every plan this module returns (checked by the tests on random inputs): ranks are
//! numbered `0..world_size` node-major (node 0 holds ranks `0..local_size[0]`, and so on, as
//! `mpirun --map-by slot` places them without oversubscription); every node in the plan holds at
//! least one rank; local ranks on a node are `0..local_size`; node ids are `0..nodes.len()` in
//! hostfile order; `1 <= world_size <= MAX_RANKS`.
//!
//! Placement policy: `--np` smaller than the total slots fills the hosts in file order, leaving the
//! last ones partly or wholly unused (unused hosts are not in the plan). `--np` larger than the total
//! slots is an error unless `--oversubscribe` is given; then the extra ranks are dealt one at a time
//! round-robin over the hosts, never beyond a host's `max_slots` (unlimited when absent), and an
//! error remains if even `max_slots` cannot hold them. Without a hostfile the plan is one node,
//! `localhost`, with `--np` slots.

use serde::Serialize;

use crate::hostfile::Hostfile;
use crate::Error;

/// The largest world size the launcher accepts (a guard against typos like `--np 10000000`).
pub const MAX_RANKS: usize = 65_536;

/// Where one rank runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RankSlot {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Rank among the ranks of its node, `0..local_size`.
    pub local_rank: usize,
    /// Index of its node in [`LaunchPlan::nodes`].
    pub node_id: usize,
    /// Its node's host name.
    pub host: String,
}

/// One node of the plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Node {
    /// Index in [`LaunchPlan::nodes`].
    pub id: usize,
    /// Host name as written in the hostfile (or `localhost`).
    pub host: String,
    /// Ranks placed on this node.
    pub local_size: usize,
    /// Slots the hostfile gave this node.
    pub slots: u32,
    /// The hostfile line the node came from, if any.
    pub line: Option<usize>,
}

/// A validated placement of every rank of a job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LaunchPlan {
    /// Number of ranks.
    pub world_size: usize,
    /// The nodes that hold at least one rank, in hostfile order.
    pub nodes: Vec<Node>,
    /// Every rank, indexed by rank.
    pub ranks: Vec<RankSlot>,
    /// Whether more ranks than slots were placed on some node.
    pub oversubscribed: bool,
}

fn check_np(np: usize) -> Result<(), Error> {
    if np == 0 {
        return Err(Error::usage("--np 0: a job needs at least one rank", "use --np 1 or more"));
    }
    if np > MAX_RANKS {
        return Err(Error::usage(
            format!("--np {np} is more than the {MAX_RANKS} ranks the launcher accepts"),
            "check the number",
        ));
    }
    Ok(())
}

impl LaunchPlan {
    /// The plan without a hostfile: one node `localhost` with `np` slots.
    pub fn local(np: usize) -> Result<LaunchPlan, Error> {
        check_np(np)?;
        let n = u32::try_from(np).unwrap_or(u32::MAX);
        Ok(Self::assemble(&[("localhost", n, None)], &[np], false))
    }

    /// Validates a parsed hostfile into a plan for `np` ranks (all slots when `None`).
    pub fn from_hosts(hostfile: &Hostfile, np: Option<usize>, oversubscribe: bool) -> Result<LaunchPlan, Error> {
        let path = &hostfile.path;
        let err = |line: usize, message: String, hint: &str| Error::Hostfile {
            path: path.clone(),
            line,
            message,
            hint: hint.to_string(),
        };
        if hostfile.entries.is_empty() {
            return Err(Error::HostfileEmpty { path: path.clone() });
        }
        let mut hosts: Vec<(&str, u32, Option<usize>)> = Vec::new();
        let mut caps: Vec<Option<u32>> = Vec::new();
        for (i, e) in hostfile.entries.iter().enumerate() {
            let slots = e.slots.unwrap_or(1);
            if slots == 0 {
                return Err(err(
                    e.line,
                    format!("host `{}` has zero slots", e.host),
                    "remove the line, or give it slots=N with N >= 1",
                ));
            }
            if let Some(max) = e.max_slots {
                if max < slots {
                    return Err(err(
                        e.line,
                        format!("host `{}`: max_slots={max} is less than slots={slots}", e.host),
                        "max_slots caps oversubscription and must be at least slots",
                    ));
                }
            }
            if let Some(first) = hostfile.entries[..i].iter().find(|f| f.host.eq_ignore_ascii_case(&e.host)) {
                return Err(err(
                    e.line,
                    format!("host `{}` is listed twice (first at line {})", e.host, first.line),
                    "list each host once, with the sum of its slots",
                ));
            }
            hosts.push((&e.host, slots, Some(e.line)));
            caps.push(e.max_slots);
        }
        let total: u64 = hosts.iter().map(|h| u64::from(h.1)).sum();
        let np = match np {
            Some(np) => np,
            None => usize::try_from(total).unwrap_or(usize::MAX).min(MAX_RANKS + 1),
        };
        check_np(np)?;
        let where_ = format!("of hostfile {}", path.display());

        let mut counts = vec![0usize; hosts.len()];
        let mut left = np;
        for (count, h) in counts.iter_mut().zip(&hosts) {
            let take = left.min(h.1 as usize);
            *count = take;
            left -= take;
        }
        let oversubscribed = left > 0;
        if oversubscribed {
            if !oversubscribe {
                return Err(Error::NotEnoughSlots {
                    np,
                    slots: total,
                    where_,
                    hint: format!(
                        "add --oversubscribe to deal the extra ranks round-robin over the hosts \
                         (they then share cores; max_slots still caps each host), or raise \
                         slots= in {}",
                        path.display()
                    ),
                });
            }
            let capacity: u64 = caps.iter().map(|c| c.map_or(np as u64, u64::from)).sum::<u64>();
            if capacity < np as u64 {
                return Err(Error::NotEnoughSlots {
                    np,
                    slots: capacity,
                    where_: format!("that max_slots allows in {}", path.display()),
                    hint: "raise or remove max_slots= on some hosts".into(),
                });
            }
            // Deal the extra ranks round-robin; capacity >= np guarantees progress in every pass.
            while left > 0 {
                for (count, cap) in counts.iter_mut().zip(&caps) {
                    if left > 0 && cap.map_or(true, |c| *count < c as usize) {
                        *count += 1;
                        left -= 1;
                    }
                }
            }
        }
        Ok(Self::assemble(&hosts, &counts, oversubscribed))
    }

    /// Builds the plan from hosts and the number of ranks on each (node-major rank order).
    fn assemble(hosts: &[(&str, u32, Option<usize>)], counts: &[usize], oversubscribed: bool) -> Self {
        let mut nodes = Vec::new();
        let mut ranks = Vec::new();
        for (&(host, slots, line), &count) in hosts.iter().zip(counts) {
            if count == 0 {
                continue;
            }
            let id = nodes.len();
            for local_rank in 0..count {
                ranks.push(RankSlot { rank: ranks.len(), local_rank, node_id: id, host: host.into() });
            }
            nodes.push(Node { id, host: host.into(), local_size: count, slots, line });
        }
        LaunchPlan { world_size: ranks.len(), nodes, ranks, oversubscribed }
    }

    /// The number of ranks on the node of `rank`.
    pub fn local_size(&self, rank: usize) -> usize {
        self.nodes[self.ranks[rank].node_id].local_size
    }

    /// Checks that every host of the plan names this machine, for the local launcher.
    pub fn require_local(&self, hostfile: Option<&std::path::Path>) -> Result<(), Error> {
        let me = gradbus_worker::host::hostname();
        for node in &self.nodes {
            let h = node.host.as_str();
            let local = matches!(h, "localhost" | "127.0.0.1" | "::1" | "[::1]")
                || me.as_deref().is_some_and(|me| {
                    h.eq_ignore_ascii_case(me)
                        || me.split('.').next().is_some_and(|short| h.eq_ignore_ascii_case(short))
                });
            if !local {
                let path = hostfile.map(|p| p.to_path_buf()).unwrap_or_default();
                return Err(Error::Hostfile {
                    path,
                    line: node.line.unwrap_or(0),
                    message: format!("host `{h}` is not this machine, and --launcher local runs every rank here"),
                    hint: "use --launcher mpirun for several machines, or name this machine `localhost`".into(),
                });
            }
        }
        Ok(())
    }

    /// Asserts the module's invariants (tests only).
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        assert!(self.world_size >= 1 && self.world_size <= MAX_RANKS);
        assert_eq!(self.ranks.len(), self.world_size);
        assert_eq!(self.nodes.iter().map(|n| n.local_size).sum::<usize>(), self.world_size);
        let mut next = 0;
        for (id, node) in self.nodes.iter().enumerate() {
            assert_eq!(node.id, id);
            assert!(node.local_size >= 1);
            assert!(self.oversubscribed || node.local_size <= node.slots as usize);
            for local_rank in 0..node.local_size {
                let r = &self.ranks[next];
                assert_eq!((r.rank, r.local_rank, r.node_id), (next, local_rank, id));
                assert_eq!(r.host, node.host);
                next += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hostfile;
    use std::path::Path;

    fn plan(text: &str, np: Option<usize>, over: bool) -> Result<LaunchPlan, Error> {
        let h = hostfile::parse(Path::new("hosts"), text.as_bytes())?;
        LaunchPlan::from_hosts(&h, np, over)
    }

    fn layout(p: &LaunchPlan) -> Vec<(&str, usize)> {
        p.nodes.iter().map(|n| (n.host.as_str(), n.local_size)).collect()
    }

    #[test]
    fn all_slots_by_default_node_major() {
        let p = plan("a slots=2\nb slots=3\nc\n", None, false).unwrap();
        p.check_invariants();
        assert_eq!(p.world_size, 6);
        assert_eq!(layout(&p), vec![("a", 2), ("b", 3), ("c", 1)]);
        let r3 = &p.ranks[3];
        assert_eq!((r3.rank, r3.local_rank, r3.node_id, r3.host.as_str()), (3, 1, 1, "b"));
        assert_eq!(p.local_size(3), 3);
    }

    #[test]
    fn smaller_np_fills_hosts_in_order() {
        let p = plan("a slots=2\nb slots=3\nc\n", Some(3), false).unwrap();
        p.check_invariants();
        assert_eq!(layout(&p), vec![("a", 2), ("b", 1)]);
    }

    #[test]
    fn larger_np_needs_oversubscribe_and_respects_max_slots() {
        let e = plan("a slots=2\nb slots=1\n", Some(5), false).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("--np 5") && msg.contains("--oversubscribe"), "{msg}");
        let p = plan("a slots=2\nb slots=1\n", Some(6), true).unwrap();
        p.check_invariants();
        assert!(p.oversubscribed);
        assert_eq!(layout(&p), vec![("a", 4), ("b", 2)]);
        let p = plan("a slots=2 max_slots=2\nb slots=1\n", Some(6), true).unwrap();
        assert_eq!(layout(&p), vec![("a", 2), ("b", 4)]);
        let e = plan("a slots=2 max_slots=2\nb max_slots=3\n", Some(6), true).unwrap_err();
        assert!(e.to_string().contains("max_slots"), "{e}");
    }

    #[test]
    fn zero_slots_duplicates_and_empty_files_are_errors_with_lines() {
        let e = plan("a\nb slots=0\n", None, false).unwrap_err();
        assert!(e.to_string().starts_with("hosts:2: host `b` has zero slots"), "{e}");
        let e = plan("a\n# x\nA slots=2\n", None, false).unwrap_err();
        assert!(e.to_string().starts_with("hosts:3: host `A` is listed twice (first at line 1)"), "{e}");
        let e = plan("a slots=4 max_slots=2\n", None, false).unwrap_err();
        assert!(e.to_string().starts_with("hosts:1:"), "{e}");
        let e = plan("# nothing\n\n", None, false).unwrap_err();
        assert!(matches!(e, Error::HostfileEmpty { .. }), "{e}");
        assert!(plan("a\n", Some(0), false).is_err());
    }

    #[test]
    fn local_plan_is_one_localhost_node() {
        let p = LaunchPlan::local(4).unwrap();
        p.check_invariants();
        assert_eq!(layout(&p), vec![("localhost", 4)]);
        p.require_local(None).unwrap();
        assert!(LaunchPlan::local(0).is_err());
        assert!(LaunchPlan::local(MAX_RANKS + 1).is_err());
        let remote = plan("far-away-node.example slots=2\n", None, false).unwrap();
        let e = remote.require_local(Some(Path::new("hosts"))).unwrap_err();
        assert!(e.to_string().starts_with("hosts:1:"), "{e}");
    }
}
