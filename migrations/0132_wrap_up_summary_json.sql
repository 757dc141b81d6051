-- `wrap_ups.summary_json` was never written: `WrapUp.summary_json` is made from the stored
-- `summary` when a wrap-up is read. No build reads the column.
ALTER TABLE wrap_ups DROP COLUMN summary_json;
