-- mm schema version 2: applied-transaction counters survive agent restarts
-- (status shows them); incremented by mm.advance_progress in the applying
-- transaction itself, so they count exactly the committed ones.
ALTER TABLE mm.apply_progress ADD COLUMN applied_txns bigint NOT NULL DEFAULT 0;
