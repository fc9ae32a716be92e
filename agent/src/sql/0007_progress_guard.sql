-- The progress guard inlined into apply statements: an UPDATE of
-- mm.apply_progress in a CTE, its row count cast to this domain. The
-- constraint name tells the agent it failed (read as MM003, like
-- mm.advance_progress's own error): the transaction before did not commit.
CREATE DOMAIN mm.progress_one AS bigint CONSTRAINT mm_progress CHECK (VALUE = 1);
