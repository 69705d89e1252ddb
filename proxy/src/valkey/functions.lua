#!lua name=kvmesh
-- kvmesh's server-side functions (proxy/src/valkey/, docs/mesh.md). Loaded by
-- every sidecar with FUNCTION LOAD REPLACE; the library's version is the
-- VERSION constant below, which the sidecar checks with kvmesh_version.
--
-- Every key of one call shares one hash tag, {PREFIX:MODEL:STRIPE}, so a
-- call runs on one cluster slot. Under a tag T:
--   T:b:<16 hex>  HASH   member id -> media bitmask: who holds this block
--   T:p:<member>  STRING the member's pod record (JSON), with a PX lease
--   T:members     SET    member ids registered under T
--   T:ring        ZSET   member id -> its position on the prefix ring
-- A member id names one registration of a pod: a pod whose engine restarted
-- or whose state Valkey lost registers again under a new id, so whatever the
-- old id wrote is fenced at once (its record is gone) and expires later.

local VERSION = '1'

local function version()
  return VERSION
end

-- KEYS: record, members, ring. ARGV: member, record JSON, lease ms, ring
-- position, 'new' or 'renew'. Returns 1, or 0 when renewing a record that
-- is gone (lease lapsed, Valkey restarted or failed over): the caller then
-- registers under a new id and rewrites its blocks.
local function register(keys, args)
  local member, record, ttl, pos, mode = args[1], args[2], args[3], args[4], args[5]
  local flag = 'NX'
  if mode == 'renew' then flag = 'XX' end
  local ok = redis.call('SET', keys[1], record, 'PX', ttl, flag)
  if not ok then
    return 0
  end
  redis.call('SADD', keys[2], member)
  redis.call('ZADD', keys[3], pos, member)
  return 1
end

-- KEYS: record, then block keys. ARGV: member, block ttl ms, then one media
-- bitmask per block key (0: the member no longer holds it). Returns the
-- number of blocks written, or -1 when the member's record is gone (fenced:
-- the caller registers again and rewrites).
local function write(keys, args)
  if redis.call('EXISTS', keys[1]) == 0 then
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

-- Drops a member whose record is gone from the member set and the ring.
local function fence(members, ring, member)
  redis.call('SREM', members, member)
  redis.call('ZREM', ring, member)
end

-- The ring position of a block key's name: its first 52 bits, exact in a
-- Lua number.
local function ring_pos(key)
  return tonumber(string.sub(key, -16, -4), 16)
end

-- KEYS: members, ring, then the request's block keys in order. ARGV: most
-- matched members, random members, ring members, how many blocks past the
-- deepest match the ring anchor is taken. Returns
--   { deepest block any live member holds, member, depth, record, pttl, ... }
-- for the matched members (deepest first, depth >= 1) and then the ring and
-- random members not already listed (depth 0). Members whose record is gone
-- are fenced on the way and left out.
local function lookup(keys, args)
  local members, ring = keys[1], keys[2]
  local most, nrandom, nring, ahead =
    tonumber(args[1]), tonumber(args[2]), tonumber(args[3]), tonumber(args[4])
  local n = #keys - 2
  local function block(i) return keys[i + 2] end

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
  -- between that probe and the previous one; a binary search with HEXISTS
  -- settles it. Big hashes (a system prompt every pod holds) are sampled.
  local out, seen, found = {}, {}, {}
  local live = {}
  local function alive(member)
    if live[member] == nil then
      local rec = redis.call('GET', string.sub(members, 1, -8) .. 'p:' .. member)
      if rec then
        live[member] = { rec, redis.call('PTTL', string.sub(members, 1, -8) .. 'p:' .. member) }
      else
        live[member] = false
        fence(members, ring, member)
      end
    end
    return live[member]
  end
  local probe, step, above = deepest, 1, n + 1
  while probe >= 1 and #found < most do
    local key = block(probe)
    local budget = most - #found
    local fields
    if redis.call('HLEN', key) > budget * 2 then
      fields = redis.call('HRANDFIELD', key, budget * 2)
    else
      fields = redis.call('HKEYS', key)
    end
    for _, member in ipairs(fields) do
      if not seen[member] and #found < most then
        seen[member] = true
        if alive(member) then
          table.insert(found, { member, probe, above - 1 })
        else
          redis.call('HDEL', key, member)
        end
      end
    end
    above = probe
    if probe == 1 then break end
    probe = math.max(1, probe - step)
    step = step * 2
  end
  for _, f in ipairs(found) do
    local member, lo2, hi2 = f[1], f[2], f[3]
    while lo2 < hi2 do
      local mid = math.floor((lo2 + hi2 + 1) / 2)
      if redis.call('HEXISTS', block(mid), member) == 1 then lo2 = mid else hi2 = mid - 1 end
    end
    local rec = live[member]
    table.insert(out, member)
    table.insert(out, lo2)
    table.insert(out, rec[1])
    table.insert(out, rec[2])
  end

  local function add(member)
    if not seen[member] then
      seen[member] = true
      local rec = alive(member)
      if rec then
        table.insert(out, member)
        table.insert(out, 0)
        table.insert(out, rec[1])
        table.insert(out, rec[2])
      end
    end
  end
  -- Homes on the ring for the prefix past the deepest match.
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
  table.insert(out, 1, deepest)
  return out
end

redis.register_function('kvmesh_version', version)
redis.register_function('kvmesh_register', register)
redis.register_function('kvmesh_write', write)
redis.register_function('kvmesh_lookup', lookup)
