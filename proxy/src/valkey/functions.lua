#!lua name=kvmesh
-- kvmesh's server-side functions (proxy/src/valkey/, docs/mesh.md). Loaded by
-- every sidecar with FUNCTION LOAD REPLACE; the library's version is the
-- VERSION constant below, which the sidecar checks with kvmesh_version.
--
-- Every key of one call shares one hash tag, {PREFIX:MODEL:STRIPE}, so a
-- call runs on one cluster slot. Under a tag T:
--   T:b:<16 hex>  HASH  member id -> media bitmask: who holds this block
--   T:a:<16 hex>  HASH  member id -> 13-digit expiry (server ms): routing
--                       decisions' guesses of who holds this approximate
--                       (text) block, without KV events (kvmesh_guess)
--   T:recs        HASH  member id -> 13-digit lease expiry (server ms) '|'
--                       the member's pod record (JSON)
--   T:members     SET   member ids registered under T
--   T:ring        ZSET  member id -> its position on the prefix ring
-- A member id names one registration of a pod: a pod whose engine restarted
-- or whose state Valkey lost registers again under a new id, so whatever the
-- old id wrote is fenced at once (its record is gone or lapsed) and its
-- block entries expire later. Leases are checked against the server's own
-- clock, so the sidecars' clocks never matter.

local VERSION = '5'

local function version()
  return VERSION
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The lease expiry of a stored record value.
local function expiry(value)
  return tonumber(string.sub(value, 1, 13))
end

-- Drops a member whose lease lapsed from the records, the set and the ring.
local function fence(recs, members, ring, member)
  redis.call('HDEL', recs, member)
  redis.call('SREM', members, member)
  redis.call('ZREM', ring, member)
end

-- KEYS: recs, members, ring. ARGV: member, record JSON, lease ms, ring
-- position, 'new' or 'renew'. Returns 1, or 0 when renewing a record that
-- is gone or lapsed (Valkey restarted or failed over, or the pod was cut off
-- longer than its lease): the caller then registers under a new id and
-- rewrites its blocks.
local function register(keys, args)
  local recs, members, ring = keys[1], keys[2], keys[3]
  local member, record, ttl, pos, mode = args[1], args[2], tonumber(args[3]), args[4], args[5]
  local now = now_ms()
  local old = redis.call('HGET', recs, member)
  if mode == 'renew' then
    if not old or expiry(old) <= now then
      return 0
    end
  elseif old then
    return 0
  end
  redis.call('HSET', recs, member, string.format('%013d', now + ttl) .. '|' .. record)
  redis.call('SADD', members, member)
  redis.call('ZADD', ring, pos, member)
  return 1
end

-- KEYS: recs, then block keys. ARGV: member, block ttl ms, then one media
-- bitmask per block key (0: the member no longer holds it). Returns the
-- number of blocks written, or -1 when the member's record is gone (fenced:
-- the caller registers again and rewrites).
local function write(keys, args)
  if redis.call('HEXISTS', keys[1], args[1]) == 0 then
    return -1
  end
  local member, ttl = args[1], args[2]
  for i = 2, #keys do
    local mask = args[i + 1]
    if mask == '0' then
      redis.call('HDEL', keys[i], member)
    else
      redis.call('HSET', keys[i], member, mask)
      redis.call('PEXPIRE', keys[i], ttl)
    end
  end
  return #keys - 1
end

-- KEYS: recs, then approximate block keys. ARGV: member, ttl ms. Records
-- the guess that the member holds each block, until now + ttl: the field's
-- value is its own expiry (a hash field has none of its own before Valkey
-- 9), and the key's is the latest of its fields'. Returns the number of
-- blocks written, or -1 when the member's record is gone (fenced).
local function guess(keys, args)
  if redis.call('HEXISTS', keys[1], args[1]) == 0 then
    return -1
  end
  local member, ttl = args[1], tonumber(args[2])
  local expires = string.format('%013d', now_ms() + ttl)
  for i = 2, #keys do
    redis.call('HSET', keys[i], member, expires)
    if redis.call('PTTL', keys[i]) < ttl then
      redis.call('PEXPIRE', keys[i], ttl)
    end
  end
  return #keys - 1
end

-- The ring position of a block key's name: its first 52 bits, exact in a
-- Lua number.
local function ring_pos(key)
  return tonumber(string.sub(key, -16, -4), 16)
end

-- KEYS: members, ring, recs, then the request's block keys in order. ARGV:
-- most matched members, random members, ring members, how many blocks past
-- the deepest match the ring anchor is taken, and 'approx' when the block
-- keys are guesses (T:a:): a member holds one while its expiry is ahead
-- (lapsed guesses met on the way are deleted). Returns
--   { deepest block any live member holds, member, depth, record, ms left
--     of its lease, ... }
-- for the matched members (deepest first, depth >= 1) and then the ring and
-- random members not already listed (depth 0). Members whose lease lapsed
-- are fenced on the way and left out.
local function lookup(keys, args)
  local members, ring, recs = keys[1], keys[2], keys[3]
  local most, nrandom, nring, ahead =
    tonumber(args[1]), tonumber(args[2]), tonumber(args[3]), tonumber(args[4])
  local n = #keys - 3
  local function block(i) return keys[i + 3] end
  local now = now_ms()
  local approx = args[5] == 'approx'

  -- Whether member holds block key.
  local function holds(key, member)
    if not approx then
      return redis.call('HEXISTS', key, member) == 1
    end
    local until_ms = tonumber(redis.call('HGET', key, member) or '')
    return until_ms ~= nil and until_ms > now
  end

  -- Up to about budget * 2 members holding block key (sampled when more
  -- do).
  local function holders(key, budget)
    local big = redis.call('HLEN', key) > budget * 2
    if not approx then
      if big then return redis.call('HRANDFIELD', key, budget * 2) end
      return redis.call('HKEYS', key)
    end
    local pairs_
    if big then
      pairs_ = redis.call('HRANDFIELD', key, budget * 2, 'WITHVALUES')
    else
      pairs_ = redis.call('HGETALL', key)
    end
    local live, lapsed = {}, {}
    for i = 1, #pairs_, 2 do
      if (tonumber(pairs_[i + 1]) or 0) > now then
        table.insert(live, pairs_[i])
      else
        table.insert(lapsed, pairs_[i])
      end
    end
    if #lapsed > 0 then redis.call('HDEL', key, unpack(lapsed)) end
    return live
  end

  -- The deepest block anybody holds. Chained keys make holding prefix-closed
  -- (a block's key names its whole prefix, and engines evict the tail of a
  -- chain first), so a binary search over EXISTS finds it.
  local lo, hi = 0, n
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if redis.call('EXISTS', block(mid)) == 1 then lo = mid else hi = mid - 1 end
  end
  local deepest = lo

  -- Members at probes deepest, deepest-1, deepest-3, deepest-7, ... and 1:
  -- each is first seen at the deepest probe it holds, so its depth lies
  -- between that probe and the previous one (those at the deepest probe
  -- hold exactly that much: nothing deeper exists). Big hashes (a system
  -- prompt every pod holds) are sampled. Their records come in one HMGET.
  local seen, found, where = {}, {}, {}
  local probe, step, above = deepest, 1, deepest + 1
  while probe >= 1 and #found < most do
    local key = block(probe)
    local fields = holders(key, most - #found)
    for _, member in ipairs(fields) do
      if not seen[member] then
        seen[member] = true
        table.insert(found, { member, probe, above - 1 })
        where[member] = key
      end
    end
    above = probe
    if probe == 1 then break end
    probe = math.max(1, probe - step)
    step = step * 2
  end

  -- Homes on the ring for the prefix past the deepest match, and a sample.
  local extra = {}
  local function add(member)
    if not seen[member] then
      seen[member] = true
      table.insert(extra, member)
    end
  end
  if nring > 0 and n > 0 then
    local pos = ring_pos(block(math.min(n, deepest + ahead)))
    local homes = redis.call('ZRANGEBYSCORE', ring, pos, '+inf', 'LIMIT', 0, nring)
    if #homes < nring then
      local wrap = redis.call('ZRANGE', ring, 0, nring - #homes - 1)
      for _, m in ipairs(wrap) do table.insert(homes, m) end
    end
    for _, m in ipairs(homes) do add(m) end
  end
  if nrandom > 0 then
    for _, m in ipairs(redis.call('SRANDMEMBER', members, nrandom)) do add(m) end
  end

  local ids = {}
  for _, f in ipairs(found) do table.insert(ids, f[1]) end
  for _, m in ipairs(extra) do table.insert(ids, m) end
  local out = { deepest }
  if #ids == 0 then
    return out
  end
  local values = redis.call('HMGET', recs, unpack(ids))
  local matched = 0
  for i, member in ipairs(ids) do
    local v = values[i]
    local left = v and (expiry(v) - now) or -1
    if left <= 0 then
      fence(recs, members, ring, member)
      if where[member] then redis.call('HDEL', where[member], member) end
    elseif i > #found or matched < most then
      if i <= #found then matched = matched + 1 end
      local depth = 0
      local f = found[i]
      if f then
        -- Settle the depth inside its bracket with a binary search.
        local lo2, hi2 = f[2], f[3]
        while lo2 < hi2 do
          local mid = math.floor((lo2 + hi2 + 1) / 2)
          if holds(block(mid), member) then lo2 = mid else hi2 = mid - 1 end
        end
        depth = lo2
      end
      table.insert(out, member)
      table.insert(out, depth)
      table.insert(out, string.sub(v, 15))
      table.insert(out, left)
    end
  end
  return out
end

-- KEYS: recs. Returns { member, record, ms left of its lease, ... } for
-- every member whose lease holds: the whole fleet under one tag, for the
-- autoscaling hook. O(members), so asked seldom and cached by the caller.
local function members(keys, args)
  local now = now_ms()
  local all = redis.call('HGETALL', keys[1])
  local out = {}
  for i = 1, #all, 2 do
    local left = expiry(all[i + 1]) - now
    if left > 0 then
      table.insert(out, all[i])
      table.insert(out, string.sub(all[i + 1], 15))
      table.insert(out, left)
    end
  end
  return out
end

redis.register_function('kvmesh_version', version)
redis.register_function('kvmesh_register', register)
redis.register_function('kvmesh_write', write)
redis.register_function('kvmesh_guess', guess)
redis.register_function('kvmesh_lookup', lookup)
redis.register_function('kvmesh_members', members)
