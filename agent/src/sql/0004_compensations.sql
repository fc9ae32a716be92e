-- mm schema version 4: compensating deletes. When the careful path removes
-- a row (or drops an incoming one) because ANOTHER row holds one of its
-- unique values, the row's own origin and the nodes that never met the
-- collision still hold it. The applying transaction records the key here;
-- after it commits, the agent deletes the key in an ordinary local
-- transaction (mm.compensate): a delete of that key, newer than every
-- version involved, that reaches every node like any local delete, so all
-- of them end alike (docs/ARCHITECTURE.md, "Unique collisions").
CREATE TABLE mm.compensations (
  id bigserial PRIMARY KEY,
  relid oid NOT NULL,
  key jsonb NOT NULL,
  -- The newest version involved: the compensating delete must be newer.
  not_before timestamptz NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now());
