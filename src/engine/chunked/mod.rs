//! Chunked snapshots read next to the running stream (adr-0028).
//!
//! A table too large to read within the CDC retention is not read before the
//! stream starts. The open records S (max LSN) and the key's extent and starts
//! the stream generation at S at once, reading nothing; the stream then keeps
//! every change after S in bronze without a gap. The `backfill` step, called
//! again until done, reads the table in chunks beside it. Each chunk only
//! needs a stamp L >= S read before its SELECT: the rebuild rule (latest row
//! per key over the snapshot's rows and the changes after S) makes a chunk
//! row that is newer than its stamp harmless, because the change that made it
//! newer is in bronze too and ranks at or above it.
//!
//! Effects, each a commit with its own txn, each followed by a failpoint:
//!
//! | effect                         | table  | txn app id                 | version    |
//! |--------------------------------|--------|----------------------------|------------|
//! | open: key extent               | plans  | `<app>#snapopen.<S>`       | 0          |
//! | open: `snapshot_open` row      | facts  | `<app>#snapshots`          | generation |
//! | plan: every chunk's bounds     | plans  | `<app>#snapplan.<S>`       | 0          |
//! | plan: `snapshot_plan` row      | facts  | `<app>#snapplan.<S>`       | 0          |
//! | wave w: the chunks' rows       | bronze | `<app>#snap.<S>`           | w          |
//! | wave w: chunk bounds and stamps| plans  | `<app>#snapchunks.<S>`     | w          |
//! | wave w: `snapshot_chunk` rows  | facts  | `<app>#snapchunks.<S>`     | w          |
//! | completion: `bootstrap` row    | facts  | `<app>#events`             | generation |
//!
//! A snapshot opened after a capture-instance switch (`engine::switch`,
//! adr-0028 Amendment 5) keys its facts open and its completion by S
//! instead (`<app>#snapopen.<S>`, `<app>#snapdone.<S>`, at the switch batch
//! id its open row records), since the generation's keys may be taken.
//!
//! Architecture invariant: key values never reach the facts table; they are
//! in the plans table (next to bronze, under bronze's access) and in bronze's
//! commit metadata. Every plans row is written before its facts row, and
//! readers read the facts first, so a facts row always finds its payload.
//!
//! Architecture invariant: the plan is made once (the first `backfill` call)
//! and never changes while the snapshot is open: a rerun, a later call with
//! other options, reconcile and silver all read the same chunks back.
//!
//! Bronze's txn decides a wave, whoever commits it: a wave whose chunks all
//! read no rows still commits to bronze (the txn and the metadata naming its
//! chunks, no files), and the plans and facts rows of wave w are only
//! written after winning bronze's txn w or, by the repair, from that commit's
//! metadata. Two `backfill` calls that both read wave w (overlapping runs;
//! their waves may even hold other chunks, since rounds follow each call's
//! pace) race for bronze's txn; the loser exits 75 with nothing recorded.
//! Before this, an all-empty wave wrote only plans and facts rows: a
//! concurrent call whose wave w read rows then committed them to bronze,
//! found the rows applied and went on, so the facts called chunks done with
//! none of the rows bronze holds for them (or, for other chunks, read them
//! again as a later wave). Plans or facts rows found already applied are
//! compared with bronze's outcome (chunks, rows, stamps, bronze version); a
//! difference is exit 3. Waves of older tables without a bronze commit stay
//! readable: the next wave number is the largest of the three txn versions.
//!
//! Waves read ahead: once a wave is read (its rows already written to data
//! files by the readers, so no rows wait in memory), its commits run while
//! the next wave is stamped and read. The next wave's commits start only
//! after the previous ones finished, so bronze takes waves in order and at
//! most the last committed wave can lack its facts rows after a crash, which
//! the next call rebuilds first. The read-ahead is one wave (adr-0028
//! Amendment 3): no more than two waves are uncommitted at once, the one
//! committing and the one being read, so a reader that would stamp a third
//! waits for the commit (`MAX_UNCOMMITTED_WAVES`).
//!
//! Capture-instance switches: chunks are read with the columns of the
//! instance the stream is on (as the facts record it), and a wave whose stamp
//! is at or past a newer instance's start pauses (exit 75) until the stream
//! has switched to it and bronze has its columns; `engine::switch` argues why
//! neither the newest instance's columns nor the older ones read past that
//! start keep bronze's latest image equal to the table.
//!
//! The files, by concern:
//!
//! - `mod.rs`: the public face: it re-exports the items the other steps use,
//!   and defines none. What those steps share with this one (the payload
//!   types, the txn ids, the rules read off the facts: which snapshot is
//!   open, which one holds the snapshot mode, a chunk's progress and a wave's
//!   pace) sits below every step, in `engine::rules`, so no step imports
//!   this module back through them.
//! - `tables.rs`: the plans and facts tables: opening, appending, reading back.
//! - `open.rs`: the open (the key check, S, the key's extent).
//! - `planning.rs`: the plan, made once over the pure planner (`engine::plan`).
//! - `backfill.rs`: the `backfill` step: its checks, the wave repair, and the
//!   loop that commits the waves in order as their chunks come in.
//! - `reader.rs`: the readers: waves stamped and handed out (one wave read
//!   ahead at most, sized by the pace, paused on budgets and headroom), and
//!   each connection's chunk reads.
//! - `wave.rs`: a wave's commits (bronze, plans, facts) and the completion
//!   (refused over a gap in the stream), and a wave's chunks rebuilt from
//!   bronze when its commit is gone.
//! - `on_switch.rs`: the snapshot a capture-instance switch opens
//!   (`snapshot.snapshot_on_switch`).

mod backfill;
mod on_switch;
mod open;
mod planning;
mod reader;
mod tables;
mod wave;

pub use self::backfill::{backfill, BackfillArgs, BackfillResult, LaneTransitions};
pub use self::on_switch::{check_open_on_switch, ensure_open_on_switch, opens_on_switch};
pub use self::open::{check_keys, ensure_bootstrap_open, ensure_open, ensure_open_with_gap, OpenResult};
pub use self::tables::open_plans;
pub(crate) use self::tables::plan_rows_if_any;
pub use self::wave::refuse_over_stream_gap;
// The rules every step shares, under the paths they had when they lived here.
pub use crate::engine::rules::{
    chunked_of_generation, full_holding_mode, full_open_of, how_to_finish, is_completed, is_superseded_full, mode_conflict,
    open_chunked, progress, round_pace, rounds_for_wave, snapshot_holding_mode, switch_batch_of, switch_to_open, ChunkPayload, Mode, OpenPayload,
    Opened, PlanPayload, PlannedChunk, Progress, EVENT_SNAPSHOT_CHUNK, EVENT_SNAPSHOT_PLAN,
};
