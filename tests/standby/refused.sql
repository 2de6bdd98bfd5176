-- On the standby: every library function that writes (volatile, but the internal trigger
-- functions and log_head, which reads the head) is refused with 25006 and a hint naming the
-- primary, whatever its arguments.
DO $$
DECLARE
    f record;
    args text;
    state text;
    hint text;
    refused int := 0;
BEGIN
    FOR f IN
        SELECT p.oid, p.proname
        FROM pg_catalog.pg_proc p
        WHERE p.pronamespace = 'sqlstreams'::regnamespace AND p.provolatile = 'v'
          AND p.prolang = (SELECT oid FROM pg_catalog.pg_language WHERE lanname = 'c')
          AND p.prorettype NOT IN ('trigger'::regtype, 'event_trigger'::regtype)
          AND p.proname NOT IN ('exception_counts_changed', 'log_head')
        ORDER BY p.proname
    LOOP
        SELECT string_agg(
                   CASE WHEN t.typcategory = 'A' THEN '''{}'''
                        WHEN t.oid = 'interval'::regtype THEN '''1 second'''
                        WHEN t.oid = 'uuid'::regtype THEN 'gen_random_uuid()'
                        WHEN t.oid = 'jsonb'::regtype THEN '''{}'''
                        WHEN t.oid = 'boolean'::regtype THEN 'false'
                        WHEN t.oid = 'timestamptz'::regtype THEN 'now()'
                        WHEN t.typcategory = 'N' THEN '1'
                        ELSE '''orders''' END || '::' || pg_catalog.format_type(t.oid, NULL),
                   ', ' ORDER BY a.ord)
        INTO args
        FROM unnest((SELECT proargtypes::oid[] FROM pg_catalog.pg_proc WHERE oid = f.oid)) WITH ORDINALITY a(typ, ord)
        JOIN pg_catalog.pg_type t ON t.oid = a.typ;
        BEGIN
            EXECUTE format('SELECT sqlstreams.%I(%s)', f.proname, coalesce(args, ''));
            RAISE EXCEPTION 'sqlstreams.%(%) ran on a standby', f.proname, args;
        EXCEPTION WHEN read_only_sql_transaction THEN
            GET STACKED DIAGNOSTICS hint = PG_EXCEPTION_HINT;
            IF hint NOT LIKE '%on the primary%' THEN
                RAISE EXCEPTION 'sqlstreams.%: hint % names no primary', f.proname, hint;
            END IF;
            refused := refused + 1;
        END;
    END LOOP;
    IF refused < 27 THEN
        RAISE EXCEPTION 'only % writing functions were refused', refused;
    END IF;
END
$$;
