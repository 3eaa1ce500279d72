fn main() {
    std::process::exit(embank_cli::run(std::env::args_os()));
}
