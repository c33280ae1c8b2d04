//! Where a drain sends each member: by free memory and CPU.
//!
//! Every candidate node (up, undrained, not the drained one) has the free
//! memory, CPUs and load its agent last reported. Members are placed
//! largest first; each goes to a node whose free memory (less what this
//! drain already sent there) holds the member's size, preferring the most
//! free memory per unit of load, where load counts the node's load average
//! plus one per member already on it or sent there by this drain, per CPU:
//! members spread over equal nodes. A node that never reported its
//! capacity (an older agent) takes any member, after every node that did.
//! A member no node can hold refuses the whole drain (see
//! [`NoRoom`]): nothing is moved.

use cr_rpc::pb;

/// A node members may go to.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub name: String,
    /// None: the agent reported no capacity.
    pub capacity: Option<pb::NodeCapacity>,
    /// Live members on it now.
    pub members: usize,
}

/// A member to place: its key and its size in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sized<K> {
    pub key: K,
    pub bytes: u64,
}

/// No node can hold member `key` of `bytes`; `best` is the node with the
/// most free memory left and how much (None: no node reported any).
#[derive(Debug, Clone, PartialEq)]
pub struct NoRoom<K> {
    pub key: K,
    pub bytes: u64,
    pub best: Option<(String, u64)>,
}

/// Per member (in the order given) its node; an empty `nodes` places
/// nothing (`Ok` of an empty list).
pub fn place<K: Clone + Ord>(
    nodes: &[Candidate],
    members: &[Sized<K>],
) -> Result<Vec<(K, String)>, NoRoom<K>> {
    if nodes.is_empty() {
        return Ok(Vec::new());
    }
    // Per node: memory left, members (on it and sent).
    let mut left: Vec<Option<u64>> = nodes
        .iter()
        .map(|n| n.capacity.as_ref().map(|c| c.mem_free))
        .collect();
    let mut count: Vec<usize> = nodes.iter().map(|n| n.members).collect();
    let mut order: Vec<&Sized<K>> = members.iter().collect();
    order.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.key.cmp(&b.key)));
    let mut out = Vec::with_capacity(members.len());
    for m in order {
        let score = |i: usize| -> (bool, f64) {
            match (&nodes[i].capacity, left[i]) {
                (Some(c), Some(free)) => {
                    let per_cpu = (c.load + count[i] as f64) / c.cpus.max(0.01);
                    (true, free as f64 / (1.0 + per_cpu))
                }
                // Unknown capacity: after every known one, fewest members first.
                _ => (false, -(count[i] as f64)),
            }
        };
        let best = (0..nodes.len())
            .filter(|&i| left[i].is_none_or(|free| free >= m.bytes))
            .max_by(|&a, &b| {
                let (sa, sb) = (score(a), score(b));
                sa.0.cmp(&sb.0)
                    .then(sa.1.total_cmp(&sb.1))
                    // Equal: the first by name.
                    .then_with(|| nodes[b].name.cmp(&nodes[a].name))
            });
        let Some(i) = best else {
            let best = (0..nodes.len())
                .filter_map(|i| Some((nodes[i].name.clone(), left[i]?)))
                .max_by_key(|(_, f)| *f);
            return Err(NoRoom {
                key: m.key.clone(),
                bytes: m.bytes,
                best,
            });
        };
        if let Some(f) = &mut left[i] {
            *f -= m.bytes;
        }
        count[i] += 1;
        out.push((m.key.clone(), nodes[i].name.clone()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn node(name: &str, free_mib: u64, cpus: f64, load: f64) -> Candidate {
        Candidate {
            name: name.into(),
            capacity: Some(pb::NodeCapacity {
                mem_free: free_mib * MIB,
                mem_source: "meminfo".into(),
                cpus,
                load,
            }),
            members: 0,
        }
    }

    fn m(pid: i32, mib: u64) -> Sized<i32> {
        Sized {
            key: pid,
            bytes: mib * MIB,
        }
    }

    #[test]
    fn a_capped_node_gets_nothing_too_big() {
        let nodes = [node("n2", 1000, 2.0, 0.0), node("n3", 20, 2.0, 0.0)];
        let p = place(&nodes, &[m(1, 100), m(2, 100), m(3, 100)]).unwrap();
        assert!(p.iter().all(|(_, n)| n == "n2"), "{p:?}");
    }

    #[test]
    fn members_spread_over_equal_nodes() {
        let nodes = [node("n2", 1000, 2.0, 0.0), node("n3", 1000, 2.0, 0.0)];
        let p = place(&nodes, &[m(1, 10), m(2, 10), m(3, 10), m(4, 10)]).unwrap();
        let on = |n: &str| p.iter().filter(|(_, t)| t == n).count();
        assert_eq!((on("n2"), on("n3")), (2, 2), "{p:?}");
    }

    #[test]
    fn load_and_cpus_count() {
        // Same memory; n3 is loaded, n2 is not.
        let nodes = [node("n2", 1000, 4.0, 0.0), node("n3", 1000, 1.0, 3.0)];
        let p = place(&nodes, &[m(1, 10)]).unwrap();
        assert_eq!(p, vec![(1, "n2".to_string())]);
    }

    #[test]
    fn sent_members_use_up_memory() {
        // 150 MiB free: one 100 MiB member fits, the second goes elsewhere.
        let nodes = [node("n2", 150, 8.0, 0.0), node("n3", 120, 1.0, 0.0)];
        let p = place(&nodes, &[m(1, 100), m(2, 100)]).unwrap();
        let mut to: Vec<&str> = p.iter().map(|(_, n)| n.as_str()).collect();
        to.sort();
        assert_eq!(to, ["n2", "n3"], "{p:?}");
    }

    #[test]
    fn no_room_names_the_member() {
        let nodes = [node("n2", 50, 2.0, 0.0), node("n3", 80, 2.0, 0.0)];
        let e = place(&nodes, &[m(1, 10), m(7, 100)]).unwrap_err();
        assert_eq!(e.key, 7);
        assert_eq!(e.bytes, 100 * MIB);
        assert_eq!(e.best, Some(("n3".into(), 80 * MIB)));
    }

    #[test]
    fn unknown_capacity_comes_last() {
        let mut old = node("n1", 0, 1.0, 0.0);
        old.capacity = None;
        let nodes = [old, node("n2", 100, 1.0, 0.0)];
        let p = place(&nodes, &[m(1, 50), m(2, 60)]).unwrap();
        assert_eq!(p, vec![(2, "n2".into()), (1, "n1".into())]);
        assert!(place(&[], &[m(1, 1)]).unwrap().is_empty());
    }
}
