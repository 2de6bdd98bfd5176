//! `library-schema LIBRARY CONTROL VERSION`: writes the SQL pgrx would generate for the
//! library's functions and triggers had they not said `sql = false`, from the entities the
//! library embeds (the section `cargo pgrx schema` reads), with pgrx's own generator.
//!
//! The extension's install script is written by hand (sql/) and is the schema pgrx installs;
//! `scripts/rig test` installs this output beside it and checks that the two declare the same
//! functions with the same signatures and entry points, since a declaration that disagrees
//! with the Rust signature would hand the library arguments of the wrong type.

use std::error::Error;

use object::{Object, ObjectSection};
use pgrx_sql_entity_graph::section::{decode_entities, is_schema_section_name};
use pgrx_sql_entity_graph::{ControlFile, PgrxSql, SqlGraphEntity};

fn main() -> Result<(), Box<dyn Error + Send + Sync>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [library, control, version] = args.as_slice() else {
        return Err("usage: library-schema LIBRARY CONTROL VERSION".into());
    };
    let data = std::fs::read(library).map_err(|e| format!("{library}: {e}"))?;
    let file = object::File::parse(&*data)?;
    let section = file
        .sections()
        .find(|s| s.name().is_ok_and(is_schema_section_name))
        .ok_or_else(|| format!("{library} embeds no pgrx schema section"))?;
    let mut entities =
        vec![SqlGraphEntity::ExtensionRoot(ControlFile::from_path_with_cargo_version(control, version)?)];
    for entity in decode_entities(section.data()?)? {
        entities.push(match entity {
            // The hand-written script itself: what this output is compared with.
            SqlGraphEntity::CustomSql(_) => continue,
            SqlGraphEntity::Function(mut function) => {
                function.to_sql_config.enabled = true;
                SqlGraphEntity::Function(function)
            }
            SqlGraphEntity::Trigger(mut trigger) => {
                trigger.to_sql_config.enabled = true;
                SqlGraphEntity::Trigger(trigger)
            }
            other => other,
        });
    }
    PgrxSql::build(entities.into_iter(), "sqlstreams".into(), false)?.write(&mut std::io::stdout())?;
    Ok(())
}
