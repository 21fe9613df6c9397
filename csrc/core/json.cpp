#include "core/json.h"

#include <unordered_set>

namespace pyloader::json {

const Value* Value::find(std::string_view key) const {
  for (const auto& [k, v] : members)
    if (k == key) return &v;
  return nullptr;
}

const char* Value::kind_name() const {
  switch (kind) {
    case Kind::Null: return "null";
    case Kind::Bool: return "a boolean";
    case Kind::Number: return "a number";
    case Kind::String: return "a string";
    case Kind::Array: return "an array";
    case Kind::Object: return "an object";
  }
  return "?";
}

bool valid_utf8(std::string_view s) {
  size_t i = 0, n = s.size();
  while (i < n) {
    auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) { ++i; continue; }
    int len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
    else return false;
    if (i + len > n) return false;
    for (int k = 1; k < len; ++k) {
      auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    static const uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += len;
  }
  return true;
}

namespace {

class Parser {
 public:
  Parser(std::string_view in, int max_depth) : s_(in), max_depth_(max_depth) {}

  Value run() {
    skip_ws();
    Value v = value(0);
    skip_ws();
    if (p_ != s_.size()) fail("unexpected data after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    throw ParseError(what + " at byte " + std::to_string(p_));
  }
  void skip_ws() {
    while (p_ < s_.size() && (s_[p_] == ' ' || s_[p_] == '\t' ||
                              s_[p_] == '\n' || s_[p_] == '\r'))
      ++p_;
  }
  // Printable ASCII is quoted; any other byte is shown in hex, so the message
  // stays valid UTF-8 whatever the input.
  static std::string describe_byte(char c) {
    auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f) return std::string("unexpected character '") + c + "'";
    static const char kHex[] = "0123456789ABCDEF";
    return std::string("unexpected byte 0x") + kHex[u >> 4] + kHex[u & 15];
  }
  bool eat(char c) {
    if (p_ < s_.size() && s_[p_] == c) { ++p_; return true; }
    return false;
  }
  void expect_word(std::string_view w) {
    if (s_.substr(p_, w.size()) != w) fail("invalid literal");
    p_ += w.size();
  }

  Value value(int depth) {
    if (depth > max_depth_) fail("nesting deeper than " + std::to_string(max_depth_));
    if (p_ >= s_.size()) fail("unexpected end of JSON");
    Value v;
    char c = s_[p_];
    if (c == '{') { v.kind = Value::Kind::Object; object(v, depth); }
    else if (c == '[') { v.kind = Value::Kind::Array; array(v, depth); }
    else if (c == '"') { v.kind = Value::Kind::String; v.text = string(); }
    else if (c == 't') { expect_word("true"); v.kind = Value::Kind::Bool; v.boolean = true; }
    else if (c == 'f') { expect_word("false"); v.kind = Value::Kind::Bool; }
    else if (c == 'n') { expect_word("null"); }
    else if (c == '-' || (c >= '0' && c <= '9')) { v.kind = Value::Kind::Number; number(v); }
    else fail(describe_byte(c));
    return v;
  }

  void object(Value& v, int depth) {
    ++p_;  // {
    std::unordered_set<std::string> seen;
    skip_ws();
    if (eat('}')) return;
    for (;;) {
      skip_ws();
      if (p_ >= s_.size() || s_[p_] != '"') fail("expected a string key");
      std::string key = string();
      if (!seen.insert(key).second) fail("duplicate key '" + key + "'");
      skip_ws();
      if (!eat(':')) fail("expected ':'");
      skip_ws();
      Value child = value(depth + 1);
      v.members.emplace_back(std::move(key), std::move(child));
      skip_ws();
      if (eat(',')) continue;
      if (eat('}')) return;
      fail("expected ',' or '}'");
    }
  }

  void array(Value& v, int depth) {
    ++p_;  // [
    skip_ws();
    if (eat(']')) return;
    for (;;) {
      skip_ws();
      v.items.push_back(value(depth + 1));
      skip_ws();
      if (eat(',')) continue;
      if (eat(']')) return;
      fail("expected ',' or ']'");
    }
  }

  void number(Value& v) {
    size_t start = p_;
    bool plain = true;
    if (eat('-')) plain = false;
    if (p_ >= s_.size()) fail("truncated number");
    if (s_[p_] == '0') {
      ++p_;
    } else if (s_[p_] >= '1' && s_[p_] <= '9') {
      while (p_ < s_.size() && s_[p_] >= '0' && s_[p_] <= '9') ++p_;
    } else {
      fail("invalid number");
    }
    if (eat('.')) {
      plain = false;
      if (p_ >= s_.size() || !(s_[p_] >= '0' && s_[p_] <= '9')) fail("invalid number");
      while (p_ < s_.size() && s_[p_] >= '0' && s_[p_] <= '9') ++p_;
    }
    if (p_ < s_.size() && (s_[p_] == 'e' || s_[p_] == 'E')) {
      plain = false;
      ++p_;
      if (p_ < s_.size() && (s_[p_] == '+' || s_[p_] == '-')) ++p_;
      if (p_ >= s_.size() || !(s_[p_] >= '0' && s_[p_] <= '9')) fail("invalid number");
      while (p_ < s_.size() && s_[p_] >= '0' && s_[p_] <= '9') ++p_;
    }
    v.text = std::string(s_.substr(start, p_ - start));
    if (plain) {
      uint64_t x = 0;
      bool fits = true;
      for (char d : v.text) {
        uint64_t digit = static_cast<uint64_t>(d - '0');
        if (x > (UINT64_MAX - digit) / 10) { fits = false; break; }
        x = x * 10 + digit;
      }
      v.is_uint = fits;
      v.uint = fits ? x : 0;
    }
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  uint32_t hex4() {
    if (p_ + 4 > s_.size()) fail("truncated \\u escape");
    uint32_t cp = 0;
    for (int i = 0; i < 4; ++i) {
      char h = s_[p_++];
      cp <<= 4;
      if (h >= '0' && h <= '9') cp |= h - '0';
      else if (h >= 'a' && h <= 'f') cp |= h - 'a' + 10;
      else if (h >= 'A' && h <= 'F') cp |= h - 'A' + 10;
      else fail("invalid \\u escape");
    }
    return cp;
  }

  std::string string() {
    ++p_;  // "
    std::string out;
    for (;;) {
      if (p_ >= s_.size()) fail("unterminated string");
      char c = s_[p_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') { out += c; continue; }
      if (p_ >= s_.size()) fail("unterminated escape");
      char e = s_[p_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (!(eat('\\') && eat('u'))) fail("unpaired surrogate escape");
            uint32_t lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("unpaired surrogate escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("unpaired surrogate escape");
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("invalid escape");
      }
    }
  }

  std::string_view s_;
  size_t p_ = 0;
  int max_depth_;
};

}  // namespace

Value parse(std::string_view input, int max_depth) {
  return Parser(input, max_depth).run();
}

}  // namespace pyloader::json
