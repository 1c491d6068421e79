// SPDX-License-Identifier: Apache-2.0
//! @file cli.hpp  What prox's command-line tools share on top of CLI11: the help layout, the one
//! error and --help behaviour, and comma-list options. Not part of the library.
//!
//! Behaviour of every tool (checked by ctest without a GPU, since flags are parsed first):
//!   - --help / -h prints the usage to stdout and exits 0;
//!   - a bad flag or value prints one line "<tool>: error: <CLI11's message>" to stderr and exits 2,
//!     e.g. "prox_alpha: error: --pdl: '2' is not one of 0, 1".
//!
//! @code
//! CLI::App app{"measure alpha", "prox_alpha"};
//! prox_support::cli::setup(app, prox_support::cli::Syntax::kEquals);
//! app.add_option("--shapes", o.shapes, "shapes")->type_name("LIST")->check(list_check(...));
//! if (const auto rc = prox_support::cli::parse(app, argc, argv)) return *rc;
//! @endcode
#pragma once

#include <CLI/CLI.hpp>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace prox_support::cli {

//! How the help spells an option that takes a value. Both spellings parse either way.
enum class Syntax {
  kEquals,  //!< --name=VALUE (the tools that sit beside Google Benchmark's --benchmark_x=...)
  kSpace,   //!< --name VALUE
};

/**
 * @brief CLI11's default help, laid out as prox's tools always printed it: "usage: <tool>
 * [options]", an option as --name=TYPE or --name TYPE, and its default (where the option captured
 * one) after its description in brackets, wrapped to `kWidth` columns.
 */
class HelpFormatter : public CLI::Formatter {
 public:
  static constexpr std::size_t kWidth = 100;
  static constexpr std::size_t kColumn = 28;

  explicit HelpFormatter(Syntax syntax) : syntax_(syntax) {
    label("Usage", "usage");
    label("OPTIONS", "options");
    column_width(kColumn);
  }
  std::string make_option_opts(const CLI::Option* opt) const override {
    std::string type = opt->get_option_text().empty() ? opt->get_type_name() : opt->get_option_text();
    type = type.substr(0, type.find(':'));  // without validators' descriptions: the text says it
    if (type.empty()) return {};            // a flag
    return (syntax_ == Syntax::kEquals ? "=" : " ") + type;
  }
  std::string make_option_desc(const CLI::Option* opt) const override {
    std::string d = opt->get_description();
    if (!opt->get_default_str().empty()) d += " [" + opt->get_default_str() + "]";
    return wrap(d, kWidth - kColumn);
  }

  //! Words of `text` in lines of at most `width` characters (CLI11 indents each '\n' to the column).
  static std::string wrap(const std::string& text, std::size_t width) {
    std::istringstream words(text);
    std::string out, line, w;
    while (words >> w) {
      if (!line.empty() && line.size() + 1 + w.size() > width) {
        out += line + "\n";
        line.clear();
      }
      line += (line.empty() ? "" : " ") + w;
    }
    return out + line;
  }

 private:
  Syntax syntax_;
};

/**
 * @brief Give `app` the tools' conventions: the help layout above, -h/--help, and "the last one
 * wins" for an option given twice (as the hand-written parsers did). Call before adding options.
 */
inline void setup(CLI::App& app, Syntax syntax) {
  app.formatter(std::make_shared<HelpFormatter>(syntax));
  app.set_help_flag("-h,--help", "print this help and exit");
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
}

//! The one error line of every tool, to stderr: "<tool>: error: <message>".
inline void print_error(const CLI::App& app, const std::string& message) {
  std::cerr << app.get_name() << ": error: " << message << std::endl;
}

/**
 * @brief Parse argv. Returns the exit code when the program should stop: 0 after --help (usage
 * printed to stdout), 2 after a bad flag or value (one error line on stderr); nullopt to go on.
 */
inline std::optional<int> parse(CLI::App& app, int argc, const char* const* argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::ParseError& e) {
    print_error(app, e.what());
    return 2;
  }
  return std::nullopt;
}

// ---------------------------------------------------------------- value checks
//! A test of one value: "" when good, else what it is not ("not one of f16, bf16"). The checks
//! below word their errors themselves, identically under every CLI11 version (CLI11's own
//! CLI::Range words them differently from 2.1 to 2.4).
using ItemTest = std::function<std::string(const std::string&)>;

//! The items of a comma list, white space removed, empty items dropped: " 8B, 14B," -> {8B, 14B}.
inline std::vector<std::string> split_list(const std::string& s, char sep = ',') {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else if (!std::isspace(static_cast<unsigned char>(c))) {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

//! A validator of one value: "--iterations: '0' is not an integer in [1, 100000]".
inline CLI::Validator value_check(ItemTest test) {
  return CLI::Validator(
      [test = std::move(test)](std::string& s) -> std::string {
        const std::string why = test(s);
        return why.empty() ? why : "'" + s + "' is " + why;
      },
      "");
}

/**
 * @brief A validator of a comma list (the option keeps the string): every item passes `test`, and
 * the list is not empty. "--dtypes: 'f32' is not one of f16, bf16".
 */
inline CLI::Validator list_check(ItemTest test) {
  return CLI::Validator(
      [test = std::move(test)](std::string& s) -> std::string {
        const std::vector<std::string> items = split_list(s);
        if (items.empty()) return "'" + s + "' is an empty list";
        for (const std::string& i : items) {
          const std::string why = test(i);
          if (!why.empty()) return "'" + i + "' is " + why;
        }
        return {};
      },
      "");
}

//! One of `choices` (exact match).
inline ItemTest one_of(std::vector<std::string> choices) {
  return [choices = std::move(choices)](const std::string& v) -> std::string {
    std::string all;
    for (const std::string& c : choices) {
      if (v == c) return {};
      all += (all.empty() ? "" : ", ") + c;
    }
    return "not one of " + all;
  };
}

namespace detail {
//! The whole of `v` as a number: *x and true, or false ("1.5x", "", "abc").
inline bool whole_number(const std::string& v, double* x) {
  std::size_t used = 0;
  try {
    *x = std::stod(v, &used);
  } catch (const std::exception&) {
    return false;
  }
  return used == v.size();
}
}  // namespace detail

//! A number in [lo, hi]; with `integer`, written as an integer ("-12", not "1e3" or "5.0"), so that
//! std::stoi reads the value that was checked.
inline ItemTest number_in(double lo, double hi, bool integer = false) {
  return [lo, hi, integer](const std::string& v) -> std::string {
    bool written_as_integer = !v.empty();
    for (std::size_t i = 0; i < v.size(); ++i)
      written_as_integer =
          written_as_integer && (std::isdigit(static_cast<unsigned char>(v[i])) || (i == 0 && v[i] == '-'));
    double x = 0.0;
    if (detail::whole_number(v, &x) && x >= lo && x <= hi && (!integer || written_as_integer)) return {};
    std::ostringstream why;
    why << std::setprecision(12) << "not " << (integer ? "an integer" : "a number") << " in [" << lo << ", " << hi
        << "]";
    return why.str();
  };
}

//! A finite number > 0.
inline ItemTest positive_number() {
  return [](const std::string& v) -> std::string {
    double x = 0.0;
    return detail::whole_number(v, &x) && x > 0.0 && std::isfinite(x) ? std::string() : std::string("not a number > 0");
  };
}

//! Decimal digits only (a non-negative integer of any size, e.g. a 64-bit seed).
inline ItemTest digits() {
  return [](const std::string& v) -> std::string {
    bool ok = !v.empty();
    for (char c : v) ok = ok && std::isdigit(static_cast<unsigned char>(c));
    return ok ? std::string() : std::string("not a non-negative integer");
  };
}

}  // namespace prox_support::cli
