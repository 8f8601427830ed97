//! Where this process stands in a data-parallel job: its rank, the world, and the rendezvous
//! address, read from the environment launchers set (`torchrun`, Slurm's `srun`, kiln's own
//! `--gpus N`) or from `--nnodes`/`--node-rank`/`--master-addr`/`--master-port`.
//!
//! Every inconsistency is refused with the names of the variables or flags that disagree, so
//! a job that would hang at the rendezvous fails at once instead.

use std::collections::HashMap;

/// The rendezvous port when neither `MASTER_PORT` nor `--master-port` gives one (torchrun's).
pub const DEFAULT_PORT: u16 = 29500;

/// Environment variable kiln sets in the processes it starts, naming the launcher.
pub const LAUNCHED_BY: &str = "KILN_LAUNCHED_BY";

/// The data-parallel flags of `kiln train`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LaunchFlags {
    /// `--gpus N|all`: processes (one per GPU) to run on this machine.
    pub gpus: Option<String>,
    pub nnodes: Option<usize>,
    pub node_rank: Option<usize>,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
}

impl LaunchFlags {
    fn multi_node_flags(&self) -> bool {
        self.nnodes.is_some() || self.node_rank.is_some()
    }
}

/// One process of a data-parallel job.
#[derive(Debug, Clone, PartialEq)]
pub struct World {
    pub rank: usize,
    pub world_size: usize,
    /// The GPU this process uses on its machine (`cuda:LOCAL_RANK`).
    pub local_rank: usize,
    /// Processes on this machine.
    pub local_world_size: usize,
    pub node_rank: usize,
    pub nnodes: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// Who set the environment: "torchrun", "slurm", "kiln" or "flags".
    pub launcher: &'static str,
}

impl World {
    /// A world of one process (`--gpus 1`): the data-parallel path with nobody to talk to.
    pub fn single(master_port: u16) -> World {
        World {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            node_rank: 0,
            nnodes: 1,
            master_addr: "127.0.0.1".into(),
            master_port,
            launcher: "flags",
        }
    }

    pub fn is_root(&self) -> bool {
        self.rank == 0
    }
}

/// What `kiln train` does with its launch settings.
#[derive(Debug, Clone, PartialEq)]
pub enum Launch {
    /// No data parallelism: the ordinary single-device run.
    Single,
    /// Start `procs` ranks on this machine (one per GPU) and wait for them.
    Spawn {
        procs: usize,
        nnodes: usize,
        node_rank: usize,
        master_addr: String,
        master_port: u16,
    },
    /// This process is one rank.
    Rank(World),
}

/// Reads the launch from `flags` and the environment `env`; `gpus_here` is the number of
/// GPUs this machine has (for `--gpus all` and the check that there are enough).
pub fn resolve(
    flags: &LaunchFlags,
    env: &HashMap<String, String>,
    gpus_here: usize,
) -> Result<Launch, String> {
    let requested = match flags.gpus.as_deref() {
        None => None,
        Some("all") => {
            if gpus_here == 0 {
                return Err("--gpus all: this machine has no CUDA GPU kiln can use (see kiln hw); train on the CPU without --gpus".into());
            }
            Some(gpus_here)
        }
        Some(s) => match s.parse::<usize>() {
            Ok(0) => {
                return Err("--gpus 0 would start no process; give 1 or more, or all".into());
            }
            Ok(n) => Some(n),
            Err(_) => {
                return Err(format!(
                    "--gpus {s:?} is not a number of GPUs; give a positive integer or all"
                ));
            }
        },
    };
    if let Some(world) = from_torchrun(env)? {
        check_flags_agree(flags, requested, &world)?;
        return Ok(Launch::Rank(world));
    }
    if let Some(world) = from_slurm(env, flags)? {
        check_flags_agree(flags, requested, &world)?;
        return Ok(Launch::Rank(world));
    }
    let Some(procs) = requested else {
        if flags.multi_node_flags() {
            return Err(
                "--nnodes and --node-rank start ranks on several machines; add --gpus N (GPUs per machine)"
                    .into(),
            );
        }
        return Ok(Launch::Single);
    };
    if procs > gpus_here {
        return Err(format!(
            "--gpus {procs}: this machine has {gpus_here} CUDA GPU{}; give at most {gpus_here} (or all)",
            if gpus_here == 1 { "" } else { "s" }
        ));
    }
    let nnodes = flags.nnodes.unwrap_or(1);
    if nnodes == 0 {
        return Err("--nnodes 0: a job needs at least one machine".into());
    }
    let node_rank = flags.node_rank.unwrap_or(0);
    if node_rank >= nnodes {
        return Err(format!(
            "--node-rank {node_rank} is not below --nnodes {nnodes}; machines are numbered 0 to {}",
            nnodes - 1
        ));
    }
    let master_addr = match (&flags.master_addr, env.get("MASTER_ADDR")) {
        (Some(a), _) => a.clone(),
        (None, Some(a)) => a.clone(),
        (None, None) if nnodes == 1 => "127.0.0.1".into(),
        (None, None) => {
            return Err(format!(
                "--nnodes {nnodes}: every machine must name the rendezvous host; add --master-addr HOST (the machine with --node-rank 0)"
            ));
        }
    };
    let master_port = match (flags.master_port, env.get("MASTER_PORT")) {
        (Some(p), _) => p,
        (None, Some(p)) => parse_port("MASTER_PORT", p)?,
        (None, None) => DEFAULT_PORT,
    };
    if procs == 1 && nnodes == 1 {
        return Ok(Launch::Rank(World::single(master_port)));
    }
    Ok(Launch::Spawn {
        procs,
        nnodes,
        node_rank,
        master_addr,
        master_port,
    })
}

fn parse_port(name: &str, value: &str) -> Result<u16, String> {
    match value.trim().parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(format!(
            "{name}={value:?} is not a TCP port; give a number from 1 to 65535"
        )),
    }
}

fn parse_count(env: &HashMap<String, String>, name: &str) -> Result<Option<usize>, String> {
    env.get(name)
        .map(|v| {
            v.trim().parse::<usize>().map_err(|_| {
                format!("{name}={v:?} is not a whole number; check the launcher's environment")
            })
        })
        .transpose()
}

/// The torchrun convention (also what `kiln train --gpus N` gives its ranks): `RANK` and
/// `WORLD_SIZE` present. `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` are then required.
fn from_torchrun(env: &HashMap<String, String>) -> Result<Option<World>, String> {
    let rank = parse_count(env, "RANK")?;
    let world_size = parse_count(env, "WORLD_SIZE")?;
    let (rank, world_size) = match (rank, world_size) {
        (None, None) => return Ok(None),
        (Some(r), Some(w)) => (r, w),
        (Some(_), None) => {
            return Err(
                "RANK is set but WORLD_SIZE is not; a launcher sets both (or unset RANK)".into(),
            );
        }
        (None, Some(_)) => {
            return Err(
                "WORLD_SIZE is set but RANK is not; a launcher sets both (or unset WORLD_SIZE)"
                    .into(),
            );
        }
    };
    if world_size == 0 {
        return Err("WORLD_SIZE=0: a job has at least one rank".into());
    }
    if rank >= world_size {
        return Err(format!(
            "RANK={rank} is not below WORLD_SIZE={world_size}; ranks are numbered 0 to {}",
            world_size - 1
        ));
    }
    let local_rank = parse_count(env, "LOCAL_RANK")?.ok_or(
        "RANK and WORLD_SIZE are set but LOCAL_RANK is not; it names the GPU of this process",
    )?;
    let local_world_size = parse_count(env, "LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
    if local_world_size == 0 || local_rank >= local_world_size {
        return Err(format!(
            "LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world_size}"
        ));
    }
    if !world_size.is_multiple_of(local_world_size) {
        return Err(format!(
            "WORLD_SIZE={world_size} is not a multiple of LOCAL_WORLD_SIZE={local_world_size}; every machine runs the same number of ranks"
        ));
    }
    let nnodes = world_size / local_world_size;
    let node_rank = rank / local_world_size;
    if let Some(g) = parse_count(env, "GROUP_RANK")?
        && g != node_rank
    {
        return Err(format!(
            "GROUP_RANK={g} disagrees with RANK={rank} / LOCAL_WORLD_SIZE={local_world_size} = {node_rank}"
        ));
    }
    if rank % local_world_size != local_rank {
        return Err(format!(
            "LOCAL_RANK={local_rank} disagrees with RANK={rank} and LOCAL_WORLD_SIZE={local_world_size} (expected {}); ranks of a machine must be consecutive",
            rank % local_world_size
        ));
    }
    let master_addr = env.get("MASTER_ADDR").cloned().ok_or(
        "RANK and WORLD_SIZE are set but MASTER_ADDR is not; it names the rendezvous host",
    )?;
    let master_port = match env.get("MASTER_PORT") {
        Some(p) => parse_port("MASTER_PORT", p)?,
        None => {
            return Err(
                "RANK and WORLD_SIZE are set but MASTER_PORT is not; it names the rendezvous port"
                    .into(),
            );
        }
    };
    let launcher = match env.get(LAUNCHED_BY).map(String::as_str) {
        Some("kiln") => "kiln",
        _ => "torchrun",
    };
    Ok(Some(World {
        rank,
        world_size,
        local_rank,
        local_world_size,
        node_rank,
        nnodes,
        master_addr,
        master_port,
        launcher,
    }))
}

/// Slurm's `srun` with one task per GPU: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`,
/// `SLURM_NODEID`, `SLURM_NNODES`. The rendezvous host is `MASTER_ADDR` or `--master-addr`,
/// else the first host of `SLURM_JOB_NODELIST`.
fn from_slurm(env: &HashMap<String, String>, flags: &LaunchFlags) -> Result<Option<World>, String> {
    let (Some(rank), Some(world_size)) = (
        parse_count(env, "SLURM_PROCID")?,
        parse_count(env, "SLURM_NTASKS")?,
    ) else {
        return Ok(None);
    };
    // One task holding several GPUs (an allocation with `--gpus N` spawning below it) is not
    // a data-parallel launch by Slurm.
    if world_size < 2 {
        return Ok(None);
    }
    if rank >= world_size {
        return Err(format!(
            "SLURM_PROCID={rank} is not below SLURM_NTASKS={world_size}"
        ));
    }
    let local_rank = parse_count(env, "SLURM_LOCALID")?
        .ok_or("SLURM_PROCID is set but SLURM_LOCALID is not; run the job step with srun")?;
    let nnodes = parse_count(env, "SLURM_NNODES")?.unwrap_or(1).max(1);
    let node_rank = parse_count(env, "SLURM_NODEID")?.unwrap_or(0);
    if !world_size.is_multiple_of(nnodes) {
        return Err(format!(
            "SLURM_NTASKS={world_size} is not a multiple of SLURM_NNODES={nnodes}; give every node the same --ntasks-per-node"
        ));
    }
    let local_world_size = world_size / nnodes;
    if local_rank >= local_world_size || node_rank >= nnodes {
        return Err(format!(
            "SLURM_LOCALID={local_rank} / SLURM_NODEID={node_rank} do not fit {nnodes} nodes of {local_world_size} tasks"
        ));
    }
    if rank != node_rank * local_world_size + local_rank {
        return Err(format!(
            "SLURM_PROCID={rank} is not SLURM_NODEID={node_rank} x {local_world_size} + SLURM_LOCALID={local_rank}; use --distribution=block so a node's tasks are consecutive"
        ));
    }
    let master_addr = match (&flags.master_addr, env.get("MASTER_ADDR")) {
        (Some(a), _) => a.clone(),
        (None, Some(a)) => a.clone(),
        (None, None) => match env.get("SLURM_JOB_NODELIST").and_then(|l| first_host(l)) {
            Some(h) => h,
            None => {
                return Err("under Slurm kiln needs the rendezvous host: set MASTER_ADDR (e.g. $(scontrol show hostnames | head -n1)) or --master-addr".into());
            }
        },
    };
    let master_port = match (flags.master_port, env.get("MASTER_PORT")) {
        (Some(p), _) => p,
        (None, Some(p)) => parse_port("MASTER_PORT", p)?,
        (None, None) => DEFAULT_PORT,
    };
    Ok(Some(World {
        rank,
        world_size,
        local_rank,
        local_world_size,
        node_rank,
        nnodes,
        master_addr,
        master_port,
        launcher: "slurm",
    }))
}

/// The first host of a Slurm node list: `a,b`, `gpu[03-08,10]`, `gpu[3-4],cpu1`.
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    if list.is_empty() {
        return None;
    }
    let end = list.find(',').unwrap_or(list.len());
    let bracket = list.find('[');
    match bracket {
        Some(b) if b < end => {
            let prefix = &list[..b];
            let inner = &list[b + 1..list[b..].find(']')? + b];
            let first = inner.split(',').next()?.split('-').next()?;
            Some(format!("{prefix}{first}"))
        }
        _ => Some(list[..end].to_string()),
    }
}

/// A launcher's flags next to its environment: `--gpus` must match the ranks per machine,
/// `--nnodes`/`--node-rank` the machines.
fn check_flags_agree(
    flags: &LaunchFlags,
    requested: Option<usize>,
    world: &World,
) -> Result<(), String> {
    let who = match world.launcher {
        "slurm" => "Slurm's environment",
        _ => "the launcher's environment (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE)",
    };
    if let Some(n) = requested
        && n != world.local_world_size
    {
        return Err(format!(
            "--gpus {n} disagrees with {who}, which runs {} rank(s) per machine; drop --gpus under a launcher",
            world.local_world_size
        ));
    }
    if let Some(n) = flags.nnodes
        && n != world.nnodes
    {
        return Err(format!(
            "--nnodes {n} disagrees with {who}, which spans {} machine(s)",
            world.nnodes
        ));
    }
    if let Some(n) = flags.node_rank
        && n != world.node_rank
    {
        return Err(format!(
            "--node-rank {n} disagrees with {who}, which makes this machine {}",
            world.node_rank
        ));
    }
    Ok(())
}

/// The environment of local rank `local` of a `--gpus` launch (what torchrun would set).
pub fn rank_env(
    procs: usize,
    nnodes: usize,
    node_rank: usize,
    local: usize,
    master_addr: &str,
    master_port: u16,
) -> Vec<(String, String)> {
    let world = procs * nnodes;
    let rank = node_rank * procs + local;
    vec![
        ("RANK".into(), rank.to_string()),
        ("WORLD_SIZE".into(), world.to_string()),
        ("LOCAL_RANK".into(), local.to_string()),
        ("LOCAL_WORLD_SIZE".into(), procs.to_string()),
        ("GROUP_RANK".into(), node_rank.to_string()),
        ("MASTER_ADDR".into(), master_addr.to_string()),
        ("MASTER_PORT".into(), master_port.to_string()),
        (LAUNCHED_BY.into(), "kiln".into()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn flags(gpus: Option<&str>) -> LaunchFlags {
        LaunchFlags {
            gpus: gpus.map(str::to_string),
            ..LaunchFlags::default()
        }
    }

    #[test]
    fn no_flags_and_no_environment_is_a_single_run() {
        assert_eq!(resolve(&flags(None), &env(&[]), 0), Ok(Launch::Single));
    }

    #[test]
    fn gpus_spawns_one_rank_per_gpu_and_one_gpu_is_a_world_of_one() {
        let l = resolve(&flags(Some("2")), &env(&[]), 4).unwrap();
        assert_eq!(
            l,
            Launch::Spawn {
                procs: 2,
                nnodes: 1,
                node_rank: 0,
                master_addr: "127.0.0.1".into(),
                master_port: DEFAULT_PORT
            }
        );
        assert_eq!(
            resolve(&flags(Some("all")), &env(&[]), 3).unwrap(),
            Launch::Spawn {
                procs: 3,
                nnodes: 1,
                node_rank: 0,
                master_addr: "127.0.0.1".into(),
                master_port: DEFAULT_PORT
            }
        );
        match resolve(&flags(Some("1")), &env(&[]), 1).unwrap() {
            Launch::Rank(w) => assert_eq!((w.rank, w.world_size), (0, 1)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_gpu_counts_are_refused_with_what_would_work() {
        let e = resolve(&flags(Some("0")), &env(&[]), 2).unwrap_err();
        assert!(e.contains("--gpus 0"), "{e}");
        let e = resolve(&flags(Some("8")), &env(&[]), 2).unwrap_err();
        assert!(
            e.contains("has 2 CUDA GPUs") && e.contains("at most 2"),
            "{e}"
        );
        let e = resolve(&flags(Some("all")), &env(&[]), 0).unwrap_err();
        assert!(e.contains("no CUDA GPU"), "{e}");
        let e = resolve(&flags(Some("two")), &env(&[]), 2).unwrap_err();
        assert!(e.contains("\"two\""), "{e}");
    }

    #[test]
    fn torchrun_environment_gives_the_rank() {
        let e = env(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ]);
        let Launch::Rank(w) = resolve(&flags(None), &e, 4).unwrap() else {
            panic!()
        };
        assert_eq!(
            (w.rank, w.world_size, w.local_rank, w.node_rank, w.nnodes),
            (5, 8, 1, 1, 2)
        );
        assert_eq!((w.master_addr.as_str(), w.master_port), ("node0", 1234));
        assert_eq!(w.launcher, "torchrun");
        // The same --gpus as the launcher's ranks per machine is accepted; another is not.
        assert!(resolve(&flags(Some("4")), &e, 4).is_ok());
        let err = resolve(&flags(Some("2")), &e, 4).unwrap_err();
        assert!(
            err.contains("--gpus 2") && err.contains("4 rank(s)"),
            "{err}"
        );
    }

    #[test]
    fn inconsistent_launcher_variables_are_named() {
        let base = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "29500"),
        ];
        let case = |drop: &str, add: &[(&str, &str)]| {
            let mut e = env(&base);
            e.remove(drop);
            for (k, v) in add {
                e.insert(k.to_string(), v.to_string());
            }
            resolve(&flags(None), &e, 2).unwrap_err()
        };
        assert!(case("WORLD_SIZE", &[]).contains("WORLD_SIZE is not"));
        assert!(case("RANK", &[]).contains("RANK is not"));
        assert!(case("LOCAL_RANK", &[]).contains("LOCAL_RANK is not"));
        assert!(case("MASTER_ADDR", &[]).contains("MASTER_ADDR"));
        assert!(case("MASTER_PORT", &[]).contains("MASTER_PORT"));
        assert!(case("", &[("RANK", "2")]).contains("RANK=2 is not below WORLD_SIZE=2"));
        assert!(case("", &[("MASTER_PORT", "http")]).contains("MASTER_PORT=\"http\""));
        assert!(case("", &[("LOCAL_WORLD_SIZE", "3")]).contains("not a multiple"));
        assert!(case("", &[("LOCAL_RANK", "0")]).contains("LOCAL_RANK=0 disagrees"));
        assert!(case("", &[("WORLD_SIZE", "x")]).contains("WORLD_SIZE=\"x\""));
    }

    #[test]
    fn slurm_environment_gives_the_rank_and_the_first_host() {
        let e = env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NNODES", "2"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
        ]);
        let Launch::Rank(w) = resolve(&flags(None), &e, 2).unwrap() else {
            panic!()
        };
        assert_eq!((w.rank, w.local_rank, w.node_rank, w.nnodes), (3, 1, 1, 2));
        assert_eq!(w.master_addr, "gpu07");
        assert_eq!(w.launcher, "slurm");
        // A single-task allocation is not a Slurm launch.
        let one = env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]);
        assert_eq!(resolve(&flags(None), &one, 0), Ok(Launch::Single));
        let mut bad = e.clone();
        bad.insert("SLURM_PROCID".into(), "2".into());
        assert!(
            resolve(&flags(None), &bad, 2)
                .unwrap_err()
                .contains("--distribution=block")
        );
    }

    #[test]
    fn node_lists_give_their_first_host() {
        assert_eq!(first_host("a,b").as_deref(), Some("a"));
        assert_eq!(first_host("gpu[03-08,10]").as_deref(), Some("gpu03"));
        assert_eq!(first_host("gpu[3-4],cpu1").as_deref(), Some("gpu3"));
        assert_eq!(first_host("solo").as_deref(), Some("solo"));
        assert_eq!(first_host(""), None);
    }

    #[test]
    fn multi_node_flags_need_a_master_and_a_valid_node_rank() {
        let mut f = flags(Some("2"));
        f.nnodes = Some(2);
        f.node_rank = Some(1);
        let e = resolve(&f, &env(&[]), 2).unwrap_err();
        assert!(e.contains("--master-addr"), "{e}");
        f.master_addr = Some("10.0.0.1".into());
        assert_eq!(
            resolve(&f, &env(&[]), 2).unwrap(),
            Launch::Spawn {
                procs: 2,
                nnodes: 2,
                node_rank: 1,
                master_addr: "10.0.0.1".into(),
                master_port: DEFAULT_PORT
            }
        );
        f.node_rank = Some(2);
        assert!(
            resolve(&f, &env(&[]), 2)
                .unwrap_err()
                .contains("--node-rank 2")
        );
        let mut g = flags(None);
        g.nnodes = Some(2);
        assert!(
            resolve(&g, &env(&[]), 2)
                .unwrap_err()
                .contains("add --gpus")
        );
    }

    #[test]
    fn rank_env_is_what_the_torchrun_reader_accepts() {
        for local in 0..3 {
            let e: HashMap<String, String> =
                rank_env(3, 2, 1, local, "h", 4000).into_iter().collect();
            let Launch::Rank(w) = resolve(&flags(Some("3")), &e, 3).unwrap() else {
                panic!()
            };
            assert_eq!(
                (w.rank, w.local_rank, w.node_rank, w.world_size),
                (3 + local, local, 1, 6)
            );
            assert_eq!(w.launcher, "kiln");
        }
    }
}
