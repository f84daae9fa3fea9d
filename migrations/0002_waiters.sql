-- Set by a request that waits for this key to finish, so that completion and release
-- send a notification only when someone listens for it: a NOTIFY serialises commits.
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS waiters boolean NOT NULL DEFAULT false;
