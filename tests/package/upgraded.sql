-- Debian package test, step 2: the package (this version) is installed with apt over 0.1.0.
-- Until ALTER EXTENSION sqlstreams UPDATE the new library refuses the old SQL and changes
-- nothing: with 55000 and a hint where a function's parameters are unchanged (ack), with
-- pgrx's unboxing error where the old declaration passes fewer arguments than the new library
-- reads (produce gained headers and deliver_after in 0.2.0). After the update, the messages
-- produced under 0.1.0 are delivered, in order, and nothing acked comes again.
\set ON_ERROR_STOP on
\set QUIET on
DO $$
DECLARE
    hint text;
    message text;
    refused boolean := false;
BEGIN
    BEGIN
        PERFORM sqlstreams.ack('package.upgraded', 'g', '00000000-0000-0000-0000-000000000000', 1);
        RAISE 'the library of the package ran ack as declared by 0.1.0';
    EXCEPTION WHEN object_not_in_prerequisite_state THEN
        GET STACKED DIAGNOSTICS hint = PG_EXCEPTION_HINT;
        IF hint NOT LIKE '%ALTER EXTENSION sqlstreams UPDATE%' THEN
            RAISE 'the refusal''s hint does not say to update: %', hint;
        END IF;
    END;
    BEGIN
        PERFORM sqlstreams.produce('package.upgraded', '{}', 'k');
    EXCEPTION WHEN internal_error THEN
        GET STACKED DIAGNOSTICS message = MESSAGE_TEXT;
        refused := message LIKE 'unboxing % argument failed';
    END;
    IF NOT refused THEN
        RAISE 'the library of the package ran produce as declared by 0.1.0 (or refused it with: %)', message;
    END IF;
END
$$;
ALTER EXTENSION sqlstreams UPDATE;
SELECT set_config('package_test.version', :'version', false);
DO $$
DECLARE
    delivered bigint[];
BEGIN
    IF (SELECT extversion FROM pg_extension WHERE extname = 'sqlstreams') IS DISTINCT FROM current_setting('package_test.version') THEN
        RAISE 'ALTER EXTENSION sqlstreams UPDATE did not reach %', current_setting('package_test.version');
    END IF;
    SELECT array_agg(message_id ORDER BY message_id) INTO delivered
    FROM sqlstreams.claim('package.upgraded', 'g', 10);
    IF delivered IS DISTINCT FROM ARRAY[2, 3]::bigint[] THEN
        RAISE 'after the upgrade the claim delivered %, not {2,3} (nothing produced or acked meanwhile)', delivered;
    END IF;
END
$$;
