//! The control plane of a data-parallel job: a TCP star around rank 0 that carries the
//! rendezvous (every rank says hello, rank 0 answers with the NCCL unique id), the small
//! collectives that keep ranks in step (token counts, loss sums, stop and out-of-memory
//! agreement, per-rank memory), and the failure watch.
//!
//! Every connection has a reader thread. A peer that disappears without saying goodbye (its
//! process died, its machine went away) or that reports a failure stops this process too
//! within moments, with a message naming the rank and host, even while the training thread
//! waits inside a GPU collective that would otherwise never return. Collectives here time out
//! after `dist.timeout_s` and name the rank that did not answer.
//!
//! Sums are taken in rank order from the same gathered values on every rank, so every rank
//! gets bit-identical results.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Exit code of a rank stopped because another rank failed or disappeared.
pub const PEER_FAILED_EXIT_CODE: i32 = 11;

const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const DATA: u8 = 3;
const ABORT: u8 = 4;
const BYE: u8 = 5;

/// What a reader thread does when its peer fails.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OnPeerFailure {
    /// Print the reason and exit the process with [`PEER_FAILED_EXIT_CODE`] (training).
    Exit,
    /// Only report it to the next collective (tests, which share one process).
    Report,
}

/// Who a rank is, as it introduced itself at the rendezvous.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Member {
    pub rank: usize,
    pub world_size: usize,
    pub host: String,
    pub pid: u32,
    /// The device it trains on, in words, and its memory in bytes (0 on the CPU).
    pub device: String,
    pub device_memory: usize,
}

#[derive(Debug)]
enum Frame {
    Msg {
        kind: u8,
        seq: u64,
        payload: Vec<u8>,
    },
    /// The connection ended; `clean` when the peer said goodbye first.
    Closed { clean: bool, reason: String },
}

struct Link {
    rank: usize,
    host: String,
    writer: TcpStream,
    rx: Receiver<Frame>,
}

/// A rank's end of the control plane.
pub struct Control {
    pub rank: usize,
    pub world_size: usize,
    /// Every rank as it introduced itself, in rank order.
    pub members: Vec<Member>,
    /// Rank 0: one link per other rank (index rank - 1). Others: one link to rank 0.
    links: Vec<Link>,
    timeout: Duration,
    seq: u64,
    finished: bool,
    failed: Arc<AtomicBool>,
}

fn write_frame(w: &mut TcpStream, kind: u8, seq: u64, payload: &[u8]) -> std::io::Result<()> {
    let mut head = [0u8; 13];
    head[..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    head[4] = kind;
    head[5..].copy_from_slice(&seq.to_le_bytes());
    w.write_all(&head)?;
    w.write_all(payload)?;
    w.flush()
}

fn read_frame(r: &mut TcpStream) -> std::io::Result<(u8, u64, Vec<u8>)> {
    let mut head = [0u8; 13];
    r.read_exact(&mut head)?;
    let len = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
    let seq = u64::from_le_bytes(head[5..].try_into().unwrap());
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    Ok((head[4], seq, payload))
}

/// Where the rendezvous is and how long to wait for it.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    pub addr: String,
    pub port: u16,
    pub timeout: Duration,
    pub on_failure: OnPeerFailure,
}

impl Rendezvous {
    fn endpoint(&self) -> String {
        format!("{}:{}", self.addr, self.port)
    }

    /// Joins the job as `me`. Rank 0 listens on the port and hands `payload` (the NCCL unique
    /// id) to every other rank; the others connect, retrying until the timeout, and return
    /// rank 0's payload. Fails naming the port in use, the address that cannot be reached,
    /// or the ranks that never arrived.
    pub fn join(&self, me: Member, payload: &[u8]) -> Result<(Control, Vec<u8>), String> {
        if me.rank == 0 {
            self.serve(me, payload)
        } else {
            self.connect(me)
        }
    }

    fn serve(&self, me: Member, payload: &[u8]) -> Result<(Control, Vec<u8>), String> {
        let world = me.world_size;
        // Every interface: the other machines reach rank 0 by its external address.
        let listener = TcpListener::bind(("0.0.0.0", self.port)).map_err(|e| {
            if e.kind() == ErrorKind::AddrInUse {
                format!(
                    "the rendezvous port {} on {} is in use (another job or program holds it); choose a free one with --master-port or MASTER_PORT",
                    self.port, me.host
                )
            } else {
                format!("cannot listen for the rendezvous on port {}: {e}", self.port)
            }
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("rendezvous socket: {e}"))?;
        let deadline = Instant::now() + self.timeout;
        let mut arrived: Vec<Option<(TcpStream, Member)>> = (0..world).map(|_| None).collect();
        let mut missing = world - 1;
        while missing > 0 {
            match listener.accept() {
                Ok((mut stream, from)) => {
                    stream.set_nonblocking(false).ok();
                    stream.set_nodelay(true).ok();
                    stream
                        .set_read_timeout(Some(
                            deadline
                                .saturating_duration_since(Instant::now())
                                .max(Duration::from_millis(100)),
                        ))
                        .ok();
                    let (kind, _, body) = match read_frame(&mut stream) {
                        Ok(f) => f,
                        // Something else knocked (a port scanner, a stale client): ignore it.
                        Err(_) => continue,
                    };
                    let Ok(m) = serde_json::from_slice::<Member>(&body) else {
                        continue;
                    };
                    if kind != HELLO {
                        continue;
                    }
                    let m: Member = m;
                    if m.world_size != world {
                        return Err(format!(
                            "rank {} on {} ({from}) was started with a world size of {} but rank 0 has {world}; start every rank with the same WORLD_SIZE (--gpus x --nnodes)",
                            m.rank, m.host, m.world_size
                        ));
                    }
                    if m.rank == 0 || m.rank >= world {
                        return Err(format!(
                            "a process on {} ({from}) joined as rank {}, which a world of {world} does not have",
                            m.host, m.rank
                        ));
                    }
                    if let Some((_, first)) = &arrived[m.rank] {
                        return Err(format!(
                            "rank {} joined twice (from {} and {}); check RANK / --node-rank on each machine",
                            m.rank, first.host, m.host
                        ));
                    }
                    stream.set_read_timeout(None).ok();
                    let rank = m.rank;
                    arrived[rank] = Some((stream, m));
                    missing -= 1;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let absent: Vec<String> = (1..world)
                            .filter(|&r| arrived[r].is_none())
                            .map(|r| r.to_string())
                            .collect();
                        return Err(format!(
                            "rank(s) {} never arrived at the rendezvous on port {} of {} within {:.0} s (world size {world}); check that every machine started and can reach {}",
                            absent.join(", "),
                            self.port,
                            me.host,
                            self.timeout.as_secs_f64(),
                            self.endpoint()
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(format!("rendezvous accept: {e}")),
            }
        }
        let mut members = vec![me.clone()];
        let mut streams = Vec::new();
        for (stream, m) in arrived.into_iter().skip(1).flatten() {
            members.push(m);
            streams.push(stream);
        }
        let welcome =
            serde_json::to_vec(&(members.clone(), payload.to_vec())).map_err(|e| e.to_string())?;
        for (s, m) in streams.iter_mut().zip(&members[1..]) {
            write_frame(s, WELCOME, 0, &welcome)
                .map_err(|e| format!("rendezvous: rank {} on {}: {e}", m.rank, m.host))?;
        }
        let control = Control::start(me.rank, world, members, streams, self)?;
        Ok((control, payload.to_vec()))
    }

    fn connect(&self, me: Member) -> Result<(Control, Vec<u8>), String> {
        let deadline = Instant::now() + self.timeout;
        let endpoint = self.endpoint();
        let mut last = String::from("no attempt");
        let mut stream = loop {
            let addrs: Vec<SocketAddr> = match endpoint.to_socket_addrs() {
                Ok(a) => a.collect(),
                Err(e) => {
                    last = format!("cannot resolve {}: {e}", self.addr);
                    Vec::new()
                }
            };
            let mut got = None;
            for a in addrs {
                match TcpStream::connect_timeout(&a, Duration::from_millis(500)) {
                    Ok(s) => {
                        got = Some(s);
                        break;
                    }
                    Err(e) => last = e.to_string(),
                }
            }
            if let Some(s) = got {
                break s;
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "rank {} could not reach the rendezvous at {endpoint} within {:.0} s ({last}); check MASTER_ADDR / --master-addr and that rank 0 is running",
                    me.rank,
                    self.timeout.as_secs_f64()
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        stream.set_nodelay(true).ok();
        let hello = serde_json::to_vec(&me).map_err(|e| e.to_string())?;
        write_frame(&mut stream, HELLO, 0, &hello)
            .map_err(|e| format!("rendezvous at {endpoint}: {e}"))?;
        stream
            .set_read_timeout(Some(
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_secs(1)),
            ))
            .ok();
        let (kind, _, body) = read_frame(&mut stream).map_err(|e| {
            format!(
                "rank {} reached {endpoint} but rank 0 did not let it in within {:.0} s ({e}); another rank may be missing or the world sizes differ",
                me.rank,
                self.timeout.as_secs_f64()
            )
        })?;
        if kind != WELCOME {
            return Err(format!(
                "the rendezvous at {endpoint} answered with something else than kiln's welcome; is another program on that port?"
            ));
        }
        stream.set_read_timeout(None).ok();
        let (members, payload): (Vec<Member>, Vec<u8>) =
            serde_json::from_slice(&body).map_err(|e| format!("rendezvous welcome: {e}"))?;
        let control = Control::start(me.rank, me.world_size, members, vec![stream], self)?;
        Ok((control, payload))
    }
}

impl Control {
    fn start(
        rank: usize,
        world_size: usize,
        members: Vec<Member>,
        streams: Vec<TcpStream>,
        rdv: &Rendezvous,
    ) -> Result<Control, String> {
        let failed = Arc::new(AtomicBool::new(false));
        // Rank 0 relays a failure to every other rank through these.
        let relay: Arc<Mutex<Vec<TcpStream>>> = Arc::new(Mutex::new(
            streams.iter().filter_map(|s| s.try_clone().ok()).collect(),
        ));
        let mut links = Vec::new();
        for (i, stream) in streams.into_iter().enumerate() {
            let peer = if rank == 0 {
                &members[i + 1]
            } else {
                &members[0]
            };
            let (tx, rx) = channel();
            let reader = stream.try_clone().map_err(|e| e.to_string())?;
            spawn_reader(
                reader,
                tx,
                peer.clone(),
                rank,
                rdv.on_failure,
                failed.clone(),
                relay.clone(),
            );
            links.push(Link {
                rank: peer.rank,
                host: peer.host.clone(),
                writer: stream,
                rx,
            });
        }
        Ok(Control {
            rank,
            world_size,
            members,
            links,
            timeout: rdv.timeout,
            seq: 0,
            finished: false,
            failed,
        })
    }

    /// Whether a peer failed or disappeared (with [`OnPeerFailure::Report`]).
    pub fn peer_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    fn send(&mut self, link: usize, kind: u8, payload: &[u8]) -> Result<(), String> {
        let seq = self.seq;
        let l = &mut self.links[link];
        write_frame(&mut l.writer, kind, seq, payload).map_err(|e| {
            format!(
                "rank {} on {} cannot be reached ({e}); it has probably stopped",
                l.rank, l.host
            )
        })
    }

    fn recv(&mut self, link: usize, what: &str) -> Result<Vec<u8>, String> {
        let seq = self.seq;
        let timeout = self.timeout;
        let l = &mut self.links[link];
        match l.rx.recv_timeout(timeout) {
            Ok(Frame::Msg {
                kind: DATA,
                seq: s,
                payload,
            }) if s == seq => Ok(payload),
            Ok(Frame::Msg {
                kind: ABORT,
                payload,
                ..
            }) => Err(format!(
                "rank {} on {} failed: {}",
                l.rank,
                l.host,
                String::from_utf8_lossy(&payload)
            )),
            Ok(Frame::Msg { kind, seq: s, .. }) => Err(format!(
                "rank {} on {} is out of step during {what} (message {kind}/{s}, expected data/{seq}); the ranks ran different code paths",
                l.rank, l.host
            )),
            Ok(Frame::Closed { clean: true, .. }) => Err(format!(
                "rank {} on {} finished the run while this rank still expected {what}; the ranks disagree on the number of steps",
                l.rank, l.host
            )),
            Ok(Frame::Closed { reason, .. }) => Err(format!(
                "rank {} on {} is gone during {what}: {reason}",
                l.rank, l.host
            )),
            Err(RecvTimeoutError::Timeout) => Err(format!(
                "rank {} on {} sent nothing for {:.0} s during {what}; it is stuck or far slower (raise dist.timeout_s if that is expected)",
                l.rank,
                l.host,
                timeout.as_secs_f64()
            )),
            Err(RecvTimeoutError::Disconnected) => Err(format!(
                "rank {} on {} is gone during {what}",
                l.rank, l.host
            )),
        }
    }

    /// Every rank's `mine`, in rank order, on every rank.
    pub fn all_gather(&mut self, mine: &[u8], what: &str) -> Result<Vec<Vec<u8>>, String> {
        self.seq += 1;
        if self.world_size == 1 {
            return Ok(vec![mine.to_vec()]);
        }
        if self.rank == 0 {
            let mut all = vec![mine.to_vec()];
            for i in 0..self.links.len() {
                all.push(self.recv(i, what)?);
            }
            let packed = pack(&all);
            for i in 0..self.links.len() {
                self.send(i, DATA, &packed)?;
            }
            Ok(all)
        } else {
            self.send(0, DATA, mine)?;
            let packed = self.recv(0, what)?;
            unpack(&packed).ok_or_else(|| format!("{what}: rank 0 sent a malformed gather"))
        }
    }

    /// Rank 0 gets every rank's `mine` in rank order; the others get `None`.
    pub fn gather(&mut self, mine: &[u8], what: &str) -> Result<Option<Vec<Vec<u8>>>, String> {
        self.seq += 1;
        if self.rank == 0 {
            let mut all = vec![mine.to_vec()];
            for i in 0..self.links.len() {
                all.push(self.recv(i, what)?);
            }
            Ok(Some(all))
        } else {
            self.send(0, DATA, mine)?;
            Ok(None)
        }
    }

    /// `data` of rank `from` on every rank (relayed by rank 0 when `from` is another rank).
    pub fn broadcast(&mut self, from: usize, data: &[u8], what: &str) -> Result<Vec<u8>, String> {
        self.seq += 1;
        if self.world_size == 1 {
            return Ok(data.to_vec());
        }
        if self.rank == 0 {
            let value = if from == 0 {
                data.to_vec()
            } else {
                self.recv(from - 1, what)?
            };
            for i in 0..self.links.len() {
                if self.links[i].rank != from {
                    self.send(i, DATA, &value)?;
                }
            }
            Ok(value)
        } else if self.rank == from {
            self.send(0, DATA, data)?;
            Ok(data.to_vec())
        } else {
            self.recv(0, what)
        }
    }

    /// Element-wise sums over ranks, added in rank order (identical on every rank).
    pub fn all_reduce_sum(&mut self, values: &mut [f64], what: &str) -> Result<(), String> {
        self.reduce_with(values, what, |a, b| a + b)
    }

    /// Element-wise maxima over ranks.
    pub fn all_reduce_max(&mut self, values: &mut [f64], what: &str) -> Result<(), String> {
        self.reduce_with(values, what, f64::max)
    }

    fn reduce_with(
        &mut self,
        values: &mut [f64],
        what: &str,
        op: impl Fn(f64, f64) -> f64,
    ) -> Result<(), String> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = self.all_gather(&bytes, what)?;
        for (k, v) in values.iter_mut().enumerate() {
            let at = |b: &Vec<u8>| f64::from_le_bytes(b[8 * k..8 * k + 8].try_into().unwrap());
            let mut acc = at(&all[0]);
            for b in &all[1..] {
                if b.len() != bytes.len() {
                    return Err(format!(
                        "{what}: ranks sent {} and {} values",
                        b.len() / 8,
                        values.len()
                    ));
                }
                acc = op(acc, at(b));
            }
            *v = acc;
        }
        Ok(())
    }

    /// Sums f32 vectors over ranks in rank order (the CPU gradient reduction).
    pub fn all_reduce_sum_f32(&mut self, values: &mut [f32], what: &str) -> Result<(), String> {
        let all = self.all_gather(&f32_bytes(values), what)?;
        let parts: Vec<Vec<f32>> = all.iter().map(|b| bytes_f32(b)).collect();
        if let Some(p) = parts.iter().find(|p| p.len() != values.len()) {
            return Err(format!(
                "{what}: ranks sent {} and {} values",
                p.len(),
                values.len()
            ));
        }
        for (k, v) in values.iter_mut().enumerate() {
            *v = parts[1..].iter().fold(parts[0][k], |acc, p| acc + p[k]);
        }
        Ok(())
    }

    /// Waits until every rank got here.
    pub fn barrier(&mut self, what: &str) -> Result<(), String> {
        self.all_gather(&[], what).map(|_| ())
    }

    /// Tells the other ranks this one failed, so they stop instead of waiting for it.
    pub fn abort(&mut self, reason: &str) {
        self.finished = true;
        for i in 0..self.links.len() {
            let _ = self.send(i, ABORT, reason.as_bytes());
        }
    }

    /// The job ends normally: every rank meets once more, then says goodbye.
    pub fn finish(&mut self) -> Result<(), String> {
        self.barrier("the end of the run")?;
        self.finished = true;
        for i in 0..self.links.len() {
            let _ = self.send(i, BYE, &[]);
        }
        Ok(())
    }
}

/// f32 values as little-endian bytes, the form they travel in.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The f32 values of [`f32_bytes`] (a trailing partial value is dropped).
pub fn bytes_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Parts as one message: each part's length (u64, little-endian) and bytes.
fn pack(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.len() + 8).sum());
    for p in parts {
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

/// The parts of a [`pack`]ed message, or `None` when it is cut short.
fn unpack(mut b: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let len = u64::from_le_bytes(b.get(..8)?.try_into().ok()?) as usize;
        out.push(b.get(8..8 + len)?.to_vec());
        b = &b[8 + len..];
    }
    Some(out)
}

impl Drop for Control {
    fn drop(&mut self) {
        if !self.finished {
            self.abort("it stopped without finishing the run (see its own error message)");
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn spawn_reader(
    mut stream: TcpStream,
    tx: Sender<Frame>,
    peer: Member,
    me: usize,
    on_failure: OnPeerFailure,
    failed: Arc<AtomicBool>,
    relay: Arc<Mutex<Vec<TcpStream>>>,
) {
    std::thread::spawn(move || {
        let mut said_bye = false;
        loop {
            match read_frame(&mut stream) {
                Ok((BYE, _, _)) => said_bye = true,
                Ok((kind, seq, payload)) => {
                    let abort = kind == ABORT;
                    let reason = String::from_utf8_lossy(&payload).to_string();
                    let _ = tx.send(Frame::Msg { kind, seq, payload });
                    if abort {
                        fail(
                            &format!("rank {} on {} failed: {reason}", peer.rank, peer.host),
                            me,
                            on_failure,
                            &failed,
                            &relay,
                        );
                        return;
                    }
                }
                Err(e) => {
                    let reason = if said_bye {
                        "it finished".to_string()
                    } else if e.kind() == ErrorKind::UnexpectedEof {
                        "its connection closed without finishing (the process ended)".to_string()
                    } else {
                        e.to_string()
                    };
                    let _ = tx.send(Frame::Closed {
                        clean: said_bye,
                        reason: reason.clone(),
                    });
                    if !said_bye {
                        fail(
                            &format!(
                                "rank {} on {} (pid {}) is gone: {reason}",
                                peer.rank, peer.host, peer.pid
                            ),
                            me,
                            on_failure,
                            &failed,
                            &relay,
                        );
                    }
                    return;
                }
            }
        }
    });
}

/// A peer failed: rank 0 tells every other rank, then (when training) this process stops.
fn fail(
    reason: &str,
    me: usize,
    on_failure: OnPeerFailure,
    failed: &AtomicBool,
    relay: &Mutex<Vec<TcpStream>>,
) {
    if failed.swap(true, Ordering::SeqCst) {
        return;
    }
    if me == 0
        && let Ok(mut peers) = relay.lock()
    {
        for s in peers.iter_mut() {
            let _ = write_frame(s, ABORT, u64::MAX, reason.as_bytes());
        }
    }
    if on_failure == OnPeerFailure::Exit {
        eprintln!(
            "kiln: rank {me} stops because {reason}. Checkpoints already written are intact; continue with kiln train --resume"
        );
        // A checkpoint being written now is finished first: exiting skips the writer
        // thread, and a write cut between its directory and its pointer leaves no `latest`.
        let _no_more_writes = crate::train::checkpoint::finish_writes_before_exit();
        std::process::exit(PEER_FAILED_EXIT_CODE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(rank: usize, world: usize) -> Member {
        Member {
            rank,
            world_size: world,
            host: format!("host{rank}"),
            pid: rank as u32,
            device: "cpu".into(),
            device_memory: 0,
        }
    }

    fn free_port() -> u16 {
        TcpListener::bind(("127.0.0.1", 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn rdv(port: u16, secs: f64) -> Rendezvous {
        Rendezvous {
            addr: "127.0.0.1".into(),
            port,
            timeout: Duration::from_secs_f64(secs),
            on_failure: OnPeerFailure::Report,
        }
    }

    /// Runs `f(rank, control)` on `world` threads joined through a loopback rendezvous.
    fn with_world<T: Send + 'static>(
        world: usize,
        f: impl Fn(usize, &mut Control) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let port = free_port();
        let f = Arc::new(f);
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let f = f.clone();
                std::thread::spawn(move || {
                    let (mut c, id) = rdv(port, 10.0)
                        .join(member(rank, world), b"the-id")
                        .unwrap();
                    assert_eq!(id, b"the-id");
                    let out = f(rank, &mut c);
                    c.finish().unwrap();
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn ranks_that_arrive_get_the_id_and_reduce_identically() {
        let out = with_world(4, |rank, c| {
            assert_eq!(c.members.len(), 4);
            assert_eq!(c.members[rank].host, format!("host{rank}"));
            let mut v = [rank as f64 + 0.1, -(rank as f64)];
            c.all_reduce_sum(&mut v, "test").unwrap();
            let mut m = [rank as f64];
            c.all_reduce_max(&mut m, "test").unwrap();
            let mut g = vec![rank as f32; 3];
            c.all_reduce_sum_f32(&mut g, "grads").unwrap();
            let b = c.broadcast(2, &[rank as u8; 2], "bcast").unwrap();
            let gathered = c.gather(&[rank as u8], "gather").unwrap();
            (v, m, g, b, gathered)
        });
        for (rank, (v, m, g, b, gathered)) in out.into_iter().enumerate() {
            assert_eq!(v, [0.1 + 1.1 + 2.1 + 3.1, -6.0]);
            assert_eq!(m, [3.0]);
            assert_eq!(g, vec![6.0; 3]);
            assert_eq!(b, vec![2, 2]);
            if rank == 0 {
                assert_eq!(gathered.unwrap(), vec![vec![0], vec![1], vec![2], vec![3]]);
            } else {
                assert!(gathered.is_none());
            }
        }
    }

    #[test]
    fn packed_parts_come_back_as_they_went() {
        let parts = vec![vec![1, 2, 3], vec![], vec![9; 1000]];
        assert_eq!(unpack(&pack(&parts)).unwrap(), parts);
        assert_eq!(unpack(&[]).unwrap(), Vec::<Vec<u8>>::new());
        let mut cut = pack(&parts);
        cut.pop();
        assert!(unpack(&cut).is_none());
    }

    #[test]
    fn a_world_of_one_needs_nobody() {
        let out = with_world(1, |_, c| {
            let mut v = [2.5];
            c.all_reduce_sum(&mut v, "t").unwrap();
            v[0]
        });
        assert_eq!(out, vec![2.5]);
    }

    #[test]
    fn a_rank_that_never_arrives_is_named_after_the_timeout() {
        let port = free_port();
        let t = std::thread::spawn(move || rdv(port, 5.0).join(member(1, 3), b"").map(|_| ()));
        let e = rdv(port, 1.5).join(member(0, 3), b"id").err().unwrap();
        assert!(e.contains("rank(s) 2 never arrived"), "{e}");
        assert!(e.contains(&port.to_string()), "{e}");
        // Rank 1 was let in by nobody: it reports that instead of hanging.
        let e1 = t.join().unwrap().unwrap_err();
        assert!(
            e1.contains("did not let it in") || e1.contains("rendezvous"),
            "{e1}"
        );
    }

    #[test]
    fn an_address_that_cannot_be_reached_times_out_naming_it() {
        let port = free_port();
        let start = Instant::now();
        let e = rdv(port, 1.0).join(member(1, 2), b"").err().unwrap();
        assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
        assert!(e.contains("could not reach"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_port_in_use_is_named() {
        let holder = TcpListener::bind(("0.0.0.0", 0)).unwrap();
        let port = holder.local_addr().unwrap().port();
        let e = rdv(port, 1.0).join(member(0, 2), b"").err().unwrap();
        assert!(
            e.contains(&format!("port {port}")) && e.contains("in use"),
            "{e}"
        );
    }

    #[test]
    fn mismatched_world_sizes_are_refused() {
        let port = free_port();
        std::thread::spawn(move || {
            let _ = rdv(port, 3.0).join(member(1, 4), b"");
        });
        let e = rdv(port, 3.0).join(member(0, 2), b"").err().unwrap();
        assert!(
            e.contains("world size of 4") && e.contains("rank 0 has 2"),
            "{e}"
        );
    }

    #[test]
    fn a_rank_that_dies_is_reported_with_its_host_instead_of_a_hang() {
        let port = free_port();
        let leaf = std::thread::spawn(move || {
            let (mut c, _) = rdv(port, 5.0).join(member(1, 2), b"").unwrap();
            // Vanish without a word: the socket closes as a dying process's would.
            c.finished = true;
            for l in &c.links {
                l.writer.shutdown(std::net::Shutdown::Both).unwrap();
            }
        });
        let (mut c, _) = rdv(port, 5.0).join(member(0, 2), b"").unwrap();
        leaf.join().unwrap();
        let start = Instant::now();
        let e = c.all_reduce_sum(&mut [1.0], "the loss sum").unwrap_err();
        assert!(e.contains("rank 1 on host1"), "{e}");
        assert!(
            start.elapsed() < Duration::from_secs(4),
            "took {:?}",
            start.elapsed()
        );
        // The reader thread marks the failure too (it may come just after the error).
        let waited = Instant::now();
        while !c.peer_failed() && waited.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(c.peer_failed());
        c.finished = true;
    }

    #[test]
    fn a_failing_rank_stops_the_others_with_its_reason() {
        let port = free_port();
        let leaf = std::thread::spawn(move || {
            let (mut c, _) = rdv(port, 5.0).join(member(1, 2), b"").unwrap();
            c.abort("bad data in shard 3");
        });
        let (mut c, _) = rdv(port, 5.0).join(member(0, 2), b"").unwrap();
        leaf.join().unwrap();
        let e = c.barrier("step 7").unwrap_err();
        assert!(
            e.contains("rank 1 on host1 failed: bad data in shard 3"),
            "{e}"
        );
        c.finished = true;
    }
}
