//! The Lua scripts the Redis broker runs: each one step, atomic on the server. Redis 7.0:
//! scripts replicate their effects, so `TIME` may decide what they write.
//!
//! Each script says what it may do (Redis 7's shebang flags): a publish is refused whole when
//! the server is over `maxmemory` (held back, as a full queue holds publishers back); what a
//! consumer runs to drain the server (claims, acks, hand-backs, a retry or dead-letter copy of
//! a delivery about to be acked, a redrive's move) runs past it (`allow-oom`), since settling
//! frees what it took; reads write nothing (`no-writes`) and run on a full server too. A script
//! that writes copies first asks the user's ACL for every command it will run
//! (`redis.acl_check_cmd`), so that a refusal comes before its first write: one script, or none.
//!
//! Keys: `s:Q` the stream of queue Q (consumer group `g`), `d:Q` its delayed copies (a sorted
//! set of ids scored by the due time in ms), `m:ID` a delayed copy's fields, `c:Q` its live
//! consumers (a sorted set scored by when their registration runs out), `sac:Q` the single
//! active consumer's lease, `v` the topology's version; all under the deployment's prefix.
//! Consumer `returned` holds what a closing consumer handed back, idle past any lease, so
//! that the next claim of any consumer takes it first, in stream order.

use redis::Script;

/// Functions the scripts share: the time in ms, a stream's ready entries (not pending, or
/// handed back), and why a stream (the i-th written) takes no new entry: it does not exist, or
/// it holds its maximum length `max` (nil: none) of ready entries.
const PRELUDE: &str = r#"
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function ready(s)
  local p = redis.call('XPENDING', s, 'g')
  local n = redis.call('XLEN', s) - p[1]
  if p[4] then
    for _, c in ipairs(p[4]) do
      if c[1] == 'returned' then n = n + tonumber(c[2]) end
    end
  end
  return n
end
local function refused(s, max, i)
  if redis.call('EXISTS', s) == 0 then return 'MISSING:' .. i end
  if max and ready(s) >= max then return 'FULL:' .. i end
  return nil
end
local function may(...)
  if not redis.acl_check_cmd(...) then
    error({ err = 'NOPERM the Redis user may not run ' .. string.upper((...)) .. ' on ' .. tostring((select(2, ...))) })
  end
end
"#;

/// What a script may do, as its first line says: run on a server over `maxmemory`.
const ALLOW_OOM: &str = "#!lua flags=allow-oom\n";

/// Writes nothing (and so runs on a full server, and on a replica).
const NO_WRITES: &str = "#!lua flags=no-writes\n";

/// Writes what grows the server: refused whole once it is over `maxmemory`.
const GROWS: &str = "#!lua\n";

/// Writes one copy of a message into every stream in `KEYS[2..]`, or none: each stream must
/// exist, and one with a maximum length (`ARGV[1 + i]`, empty for none) must hold fewer ready
/// entries. `KEYS[1]` is the topology's version (on a cluster, the queue's copy of it), which
/// must still be `ARGV[1]` (`*`: not checked) since the caller routed. `ARGV[2 + n]` is the wake channel; the fields follow.
/// Answers `OK`, `STALE`, `MISSING:i` or `FULL:i` (i: 1-based among the streams); an error
/// (`NOPERM`) before writing anything when the user may not run what it would.
const PUBLISH: &str = r#"
if ARGV[1] ~= '*' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return 'STALE' end
local n = #KEYS - 1
for i = 1, n do
  local no = refused(KEYS[1 + i], tonumber(ARGV[1 + i]), i)
  if no then return no end
  may('XADD', KEYS[1 + i], '*', 'b', '')
  may('PUBLISH', ARGV[n + 2], KEYS[1 + i])
end
for i = 1, n do
  redis.call('XADD', KEYS[1 + i], '*', unpack(ARGV, n + 3))
  redis.call('PUBLISH', ARGV[n + 2], KEYS[1 + i])
end
return 'OK'
"#;

/// Moves entry `ARGV[2]` of stream `KEYS[1]`, while it is pending for consumer `ARGV[1]`, into
/// stream `KEYS[2]` as a new entry of fields `ARGV[5..]`: the copy written and the original
/// acked and deleted, or neither, so that a move whose answer was lost is never made twice.
/// `KEYS[2]` must exist and hold fewer ready entries than `ARGV[3]` (empty: no maximum); wakes
/// its consumers on channel `ARGV[4]`. Answers `OK`, `GONE` (the entry is no longer this
/// consumer's: moved already, handed back, or taken over after its lease ran out),
/// `MISSING:1` or `FULL:1`.
const MOVE: &str = r#"
if #redis.call('XPENDING', KEYS[1], 'g', ARGV[2], ARGV[2], 1, ARGV[1]) == 0 then return 'GONE' end
local no = refused(KEYS[2], tonumber(ARGV[3]), 1)
if no then return no end
may('XADD', KEYS[2], '*', 'b', '')
may('XACK', KEYS[1], 'g', ARGV[2])
may('XDEL', KEYS[1], ARGV[2])
may('PUBLISH', ARGV[4], KEYS[2])
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 5))
redis.call('XACK', KEYS[1], 'g', ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('PUBLISH', ARGV[4], KEYS[2])
return 'OK'
"#;

/// Holds a copy until `ARGV[1]` ms from now: its fields (`ARGV[4..]`) in `KEYS[2]` (`m:ID`),
/// its id `ARGV[2]` in `KEYS[1]` (`d:Q`) scored by the due time; the stream `KEYS[3]` must
/// exist. Wakes the queue's consumers (`ARGV[3]`, the wake channel), which wait for the
/// earliest due time. Answers `OK` or `MISSING:1`.
const DELAY: &str = r#"
if redis.call('EXISTS', KEYS[3]) == 0 then return 'MISSING:1' end
may('HSET', KEYS[2], 'b', '')
may('ZADD', KEYS[1], '0', ARGV[2])
may('PUBLISH', ARGV[3], KEYS[3])
redis.call('HSET', KEYS[2], unpack(ARGV, 4))
redis.call('ZADD', KEYS[1], now_ms() + tonumber(ARGV[1]), ARGV[2])
redis.call('PUBLISH', ARGV[3], KEYS[3])
return 'OK'
"#;

/// One step of a consumer of stream `KEYS[1]`: moves the delayed copies come due (`KEYS[2]`,
/// fields under the prefix `ARGV[5]`) into the stream; renews the consumer's registration in
/// `KEYS[4]` and, with `ARGV[6]` = 1, the leases of its pending entries it says it holds
/// (`ARGV[10..]`: one a claim took but whose answer was lost goes idle, and comes back); on a
/// single-active queue
/// (`ARGV[7]` = 1) goes on only while it holds, or takes, the lease `KEYS[3]`; takes what
/// consumers handed back (consumer `returned`), first and in stream order; with `ARGV[4]` = 1
/// takes back entries idle past the lease `ARGV[3]` ms (a dead consumer's) and forgets dead
/// consumers with nothing pending; then reads new entries. It takes up to `ARGV[2]` entries in
/// all, one at a time while their bodies come to less than `ARGV[9]` bytes: a claim goes past
/// that by one body at most (a larger one comes alone). Consumer `ARGV[1]`, registered for
/// `ARGV[8]` ms (a few of its polls). Answers `{ms until the next due copy or -1, entries...}`,
/// each entry its id then its fields.
///
/// A copy come due goes into its stream whatever the queue's `max_length`, as on RabbitMQ: there
/// a retry copy leaves the last delay queue by at-least-once dead-lettering, and a quorum queue
/// (sluice's default) takes what is dead-lettered into it when full (its reject-publish blocks
/// publishing channels; the dead-letter worker ignores the block: rabbitmq-server#8495). The
/// queue admitted the message once, and the copy is that message back from its pause: the queue
/// holds at most its limit and the retries of what its consumers held. Held back instead, a
/// copy could wait for ever behind publishers that keep the queue full; refused, it would be
/// lost.
const CLAIM: &str = r#"
local me, lease = ARGV[1], tonumber(ARGV[3])
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 256)
if due[1] then
  may('XADD', KEYS[1], '*', 'b', '')
  may('DEL', ARGV[5] .. due[1])
  may('ZREM', KEYS[2], due[1])
end
for _, id in ipairs(due) do
  local fields = redis.call('HGETALL', ARGV[5] .. id)
  if #fields > 0 then
    redis.call('XADD', KEYS[1], '*', unpack(fields))
  end
  redis.call('DEL', ARGV[5] .. id)
  redis.call('ZREM', KEYS[2], id)
end
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
local out = { first[2] and math.max(0, tonumber(first[2]) - now) or -1 }
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[8]), me)
if ARGV[6] == '1' then
  local held = {}
  for i = 10, #ARGV do held[ARGV[i]] = true end
  local renew = {}
  for _, p in ipairs(redis.call('XPENDING', KEYS[1], 'g', '-', '+', 1000000, me)) do
    if held[p[1]] then renew[#renew + 1] = p[1] end
  end
  for i = 1, #renew, 500 do
    local args = { 'XCLAIM', KEYS[1], 'g', me, 0 }
    for j = i, math.min(i + 499, #renew) do args[#args + 1] = renew[j] end
    args[#args + 1] = 'JUSTID'
    redis.call(unpack(args))
  end
end
if ARGV[7] == '1' then
  local holder = redis.call('GET', KEYS[3])
  if holder and holder ~= me then return out end
  redis.call('SET', KEYS[3], me, 'PX', lease)
end
local n, bytes = tonumber(ARGV[2]), tonumber(ARGV[9])
local function more()
  return n > 0 and bytes > 0
end
local function add(entries)
  for _, e in ipairs(entries) do
    if e[2] then
      out[#out + 1] = e[1]
      out[#out + 1] = e[2]
      n = n - 1
      for i = 1, #e[2], 2 do
        if e[2][i] == 'b' then bytes = bytes - #e[2][i + 1] end
      end
    end
  end
end
-- Takes the entries `ids` names, idle at least `idle` ms, one at a time while there is room.
local function claim(ids, idle)
  for _, p in ipairs(ids) do
    if not more() then return end
    add(redis.call('XCLAIM', KEYS[1], 'g', me, idle, p[1]))
  end
end
if more() then
  claim(redis.call('XPENDING', KEYS[1], 'g', '-', '+', n, 'returned'), 0)
end
if ARGV[4] == '1' then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], 'g')) do
    local name, pending = c[2], c[4]
    if pending == 0 and name ~= me and not redis.call('ZSCORE', KEYS[4], name) then
      redis.call('XGROUP', 'DELCONSUMER', KEYS[1], 'g', name)
    end
  end
  if more() then
    claim(redis.call('XPENDING', KEYS[1], 'g', 'IDLE', lease, '-', '+', n), lease)
  end
end
while more() do
  local r = redis.call('XREADGROUP', 'GROUP', 'g', me, 'COUNT', 1, 'STREAMS', KEYS[1], '>')
  if not (r and r[1] and r[1][2][1]) then break end
  add(r[1][2])
end
return out
"#;

/// Acks entries `ARGV[first..]` of stream `KEYS[1]` that are still pending for consumer
/// `ARGV[1]` (one another consumer took over after its lease ran out stays): acked and deleted
/// at once. Safe in any order and overlapping. Answers how many it removed. The script that
/// runs it sets `first`.
const ACK_ENTRIES: &str = r#"
local done = 0
for i = first, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], 'g', ARGV[i], ARGV[i], 1, ARGV[1])
  if #p > 0 then
    redis.call('XACK', KEYS[1], 'g', ARGV[i])
    redis.call('XDEL', KEYS[1], ARGV[i])
    done = done + 1
  end
end
return done
"#;

/// [`ACK_ENTRIES`] for entries `ARGV[2..]`.
const ACK: &str = "local first = 2\n";

/// [`ACK_ENTRIES`] for entries `ARGV[4..]`, and the idempotency keys `KEYS[2..]` recorded done
/// (value `ARGV[2]`) for `ARGV[3]` ms, in one step. The keys are the idempotency store's
/// (`dedup:` under the deployment's prefix), so a duplicate's claim finds them done.
const ACK_RECORDING: &str = r#"
for i = 2, #KEYS do redis.call('SET', KEYS[i], ARGV[2], 'PX', ARGV[3]) end
local first = 4
"#;

/// Hands back what consumer `ARGV[1]` of stream `KEYS[1]` holds: its pending entries go to
/// `returned` idle for `ARGV[2]` ms (past the lease, so the next claim takes them), then the
/// consumer is forgotten (`KEYS[2]` its registration, `KEYS[3]` a single-active lease it held).
/// Wakes the queue's consumers on channel `ARGV[3]`.
const HAND_BACK: &str = r#"
local me = ARGV[1]
local mine = redis.call('XPENDING', KEYS[1], 'g', '-', '+', 1000000, me)
for i = 1, #mine, 500 do
  local args = { 'XCLAIM', KEYS[1], 'g', 'returned', 0 }
  for j = i, math.min(i + 499, #mine) do args[#args + 1] = mine[j][1] end
  args[#args + 1] = 'IDLE'
  args[#args + 1] = ARGV[2]
  args[#args + 1] = 'JUSTID'
  redis.call(unpack(args))
end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], 'g', me)
redis.call('ZREM', KEYS[2], me)
if redis.call('GET', KEYS[3]) == me then redis.call('DEL', KEYS[3]) end
redis.call('PUBLISH', ARGV[3], KEYS[1])
return #mine
"#;

/// What stream `KEYS[1]` holds: `{ready, live consumers (KEYS[2]), entries delivered under a
/// running lease `ARGV[1]` ms (a killed runner's too, until it runs out), delayed copies
/// (KEYS[3])}`. Ready: not delivered, or idle past the lease (handed back, or a dead
/// consumer's whose lease ran out: the next claim takes them).
const COUNTS: &str = r#"
local now = now_ms()
local live = redis.call('ZCOUNT', KEYS[2], now, '+inf')
local pending = redis.call('XPENDING', KEYS[1], 'g')[1]
local expired = #redis.call('XPENDING', KEYS[1], 'g', 'IDLE', ARGV[1], '-', '+', 1000000)
return { redis.call('XLEN', KEYS[1]) - pending + expired, live, math.max(0, pending - expired), redis.call('ZCARD', KEYS[3]) }
"#;

/// The topology, read at once: `{version (empty when none), exchanges, queues, limits,
/// bindings, tags}` from `KEYS[1..6]` (`v`, `x`, `q`, `limits`, `b`, `tags`), the hashes as
/// flat lists.
const READ: &str = r#"
return {
  redis.call('GET', KEYS[1]) or '',
  redis.call('HGETALL', KEYS[2]),
  redis.call('HGETALL', KEYS[3]),
  redis.call('HGETALL', KEYS[4]),
  redis.call('SMEMBERS', KEYS[5]),
  redis.call('HGETALL', KEYS[6]),
}
"#;

/// Which of the streams `KEYS` has no consumer group `g` (or is no stream yet): their
/// 1-based places. A declaration that finds every group there writes nothing.
const GROUPS: &str = r#"
local missing = {}
for i, s in ipairs(KEYS) do
  local found = false
  if redis.call('EXISTS', s) == 1 then
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', s)) do
      if g[2] == 'g' then found = true end
    end
  end
  if not found then missing[#missing + 1] = i end
end
return missing
"#;

/// Takes the single-active lease `KEYS[1]` for consumer `ARGV[1]` for `ARGV[2]` ms, unless
/// another holds it.
const LEASE: &str = r#"
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
"#;

/// Sets a queue's copy of the topology's version `KEYS[1]` to `ARGV[1]`, unless it holds a
/// newer one (versions are counted up by `INCR`).
const VERSION: &str = r#"
if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
"#;

/// Which of the commands `ARGV[4..]` the user's ACL refuses, run nothing: each a line of
/// words, `{s}`, `{k}`, `{c}` standing for `ARGV[1..3]` (not keys of the script, which a user
/// limited to other keys could not run at all). Answers their names (with the subcommand for
/// `XGROUP`, `XINFO`, `SCRIPT`).
pub(super) const PROBE: &str = r#"#!lua flags=no-writes
local names = { ['{s}'] = ARGV[1], ['{k}'] = ARGV[2], ['{c}'] = ARGV[3] }
local refused, said = {}, {}
for i = 4, #ARGV do
  local line, words = ARGV[i], {}
  for w in string.gmatch(line, '%S+') do words[#words + 1] = names[w] or w end
  local ok, allowed = pcall(redis.acl_check_cmd, unpack(words))
  if not (ok and allowed) then
    local name = words[1]
    if name == 'XGROUP' or name == 'XINFO' or name == 'SCRIPT' then name = name .. ' ' .. words[2] end
    if not said[name] then
      said[name] = true
      refused[#refused + 1] = name
    end
  end
end
return refused
"#;

/// The broker's scripts, loaded once per session (sent by hash, loaded on a miss).
pub(super) struct Scripts {
    pub publish: Script,
    /// The publish script for a copy of a delivery (a retry due now, a dead letter, a
    /// redrive's copy): it runs on a full server, as the original's ack frees its room.
    pub copy: Script,
    pub move_entry: Script,
    pub delay: Script,
    pub claim: Script,
    pub ack: Script,
    pub ack_recording: Script,
    pub hand_back: Script,
    pub counts: Script,
    pub read: Script,
    pub groups: Script,
    pub lease: Script,
    pub version: Script,
}

impl Scripts {
    pub fn new() -> Scripts {
        let with_prelude = |flags: &str, body: &str| Script::new(&format!("{flags}{PRELUDE}{body}"));
        let plain = |flags: &str, body: &str| Script::new(&format!("{flags}{body}"));
        Scripts {
            publish: with_prelude(GROWS, PUBLISH),
            copy: with_prelude(ALLOW_OOM, PUBLISH),
            move_entry: with_prelude(ALLOW_OOM, MOVE),
            delay: with_prelude(ALLOW_OOM, DELAY),
            claim: with_prelude(ALLOW_OOM, CLAIM),
            ack: plain(ALLOW_OOM, &format!("{ACK}{ACK_ENTRIES}")),
            ack_recording: plain(ALLOW_OOM, &format!("{ACK_RECORDING}{ACK_ENTRIES}")),
            hand_back: plain(ALLOW_OOM, HAND_BACK),
            counts: with_prelude(NO_WRITES, COUNTS),
            read: plain(NO_WRITES, READ),
            groups: plain(NO_WRITES, GROUPS),
            lease: plain(ALLOW_OOM, LEASE),
            version: plain(ALLOW_OOM, VERSION),
        }
    }
}
