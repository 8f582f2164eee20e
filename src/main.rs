//! The `mssql-cdc` command: a thin shell over the library (see `cli`).

fn main() {
    std::process::exit(mssql_cdc::cli::main());
}
