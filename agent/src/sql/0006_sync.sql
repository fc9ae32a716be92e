-- add-node with data, on the node being added: where its initial copy
-- stands. `copying` names the tables it is filling, so an interrupted copy
-- is undone (truncated) before it starts again; `done` is written in the
-- same transaction as the copied progress (mm.apply_progress), so the
-- streams into this node start exactly where the copy ends.
CREATE TABLE mm.sync_state (
  singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
  source text NOT NULL,
  phase text NOT NULL CHECK (phase IN ('copying', 'done')),
  tables text[] NOT NULL DEFAULT '{}',
  -- The copy created the tables from the source's definitions (indexes,
  -- keys and triggers follow the rows, as in pg_dump's restore order) ...
  created boolean NOT NULL DEFAULT false,
  -- ... and has added those (a retry of a copy that got this far must
  -- not add them twice; one that did not must still add them).
  post_data_done boolean NOT NULL DEFAULT false,
  started_at timestamptz NOT NULL DEFAULT now(),
  finished_at timestamptz);
