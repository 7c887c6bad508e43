fn main() {
    let name = std::env::args().nth(1).unwrap();
    let img = k7d_guest::Builtin::from_name(&name).unwrap().image().unwrap();
    std::fs::write(format!("/tmp/{name}.bin"), img).unwrap();
}
