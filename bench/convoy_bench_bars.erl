%% Bar charts of the scenarios that have no other plot: per point, each variant's
%% primary figure as the table's "x base" (the median of per-repeat ratios to the
%% scenario's baseline: `plain', `local' on one node, `pg2' in `pubsub'), which
%% is the line at 1. Bars start at 1 on a log scale, so that 2x and 0.5x are as
%% long and a bar's direction says more or less than the baseline. The limits
%% measured beside convoy (`ceiling', `handover', `guarded') are hatched, in
%% colours of their own. Pure: the `.dat' and the gnuplot script;
%% `convoy_bench_plot' renders them.
-module(convoy_bench_bars).

-export([chart/2, file_base/1]).

-type chart() :: #{base := string(), dat := binary(), script := binary()}.
-export_type([chart/0]).

%% The variants that bound what convoy could do, hatched apart from the others.
-define(LIMITS, [{<<"ceiling">>, "#d62728", 4}, {<<"handover">>, "#ff7f0e", 5},
                 {<<"guarded">>, "#8c564b", 6}]).
%% `convoy' (the defaults) is always blue; its other variants take the rest.
-define(CONVOY_COLOUR, "#1f5fbf").
-define(CONVOY_COLOURS, ["#2ca02c", "#17becf", "#9467bd", "#0b3d91"]).
-define(OTHER_COLOURS, ["#7f7f7f", "#b5b5b5", "#4d4d4d", "#bcbd22"]).

%% Canvas: the other plots' 900 x 560, wider by this much per bar beyond 19
%% bars (so that a bar stays about as wide as its value), and what the key and
%% the margins take of the width.
-define(HEIGHT, 560).
-define(PX_PER_BAR, 30).
-define(FRAME_PX, 330).
%% More bars than this and their values are written upright.
-define(FLAT_VALUES, 14).

%% @doc The file name (without extension) of a scenario's bar chart, e.g.
%% `flood_x_plain'.
-spec file_base(map()) -> string().
file_base(#{name := Name, baseline := Base}) ->
    lists:flatten([atom_to_list(Name), "_x_", binary_to_list(Base)]).

%% @doc The bar chart of a scenario result (`name', `spec', `baseline',
%% `summary') for the gnuplot terminal `Driver' (`"pngcairo"' or `"png"'), or why
%% there is none: no variant has a ratio of the primary figure (only the
%% baseline ran, or it failed).
-spec chart(string(), map()) -> {ok, chart()} | {error, binary()}.
chart(Driver, S = #{name := Name, spec := Spec, baseline := Base, summary := Summary}) ->
    #{points := Points, primary := {Fig, Better}, figures := Figs} = Spec,
    Labels = [L || #{label := L} <- Points],
    Ratio = fun(V, L) -> ratio(Summary, V, L, Fig) end,
    Variants = [V || V <- variants(Summary), V =/= Base,
                     lists:any(fun(L) -> Ratio(V, L) =/= none end, Labels)],
    FileBase = file_base(S),
    case Variants of
        [] ->
            {error, iolist_to_binary(io_lib:format("no ~s.png: no variant has a ratio to ~s "
                                                   "in ~s", [FileBase, Base, Name]))};
        _ ->
            {Fig, FigLabel, _} = lists:keyfind(Fig, 1, Figs),
            Bars = [{P - 1, I, V, L, R} || {P, L} <- enumerate(Labels),
                                           {I, V} <- enumerate(Variants),
                                           R <- [Ratio(V, L)], R =/= none],
            Chart = #{name => Name, fig => FigLabel, better => Better, base => Base,
                      file => FileBase, labels => Labels, variants => Variants,
                      bars => Bars},
            %% as bytes: labels and names may hold any character
            {ok, #{base => FileBase, dat => unicode:characters_to_binary(dat(Chart)),
                   script => unicode:characters_to_binary(script(Driver, Chart))}}
    end.

%% A row per point: its index (the x of its group), each variant's ratio ('?'
%% where it has none), the label last.
dat(#{labels := Labels, variants := Variants, bars := Bars}) ->
    Rows = [[integer_to_list(P - 1)
             | [case [R || {_, I2, _, L2, R} <- Bars, I2 =:= I, L2 =:= L] of
                    [R] -> float_to_list(R, [short]);
                    [] -> "?"
                end || I <- lists:seq(1, length(Variants))]]
            ++ [quote(binary:replace(L, <<"\"">>, <<"'">>, [global]))]
            || {P, L} <- enumerate(Labels)],
    [header(["i" | Variants] ++ ["point"]), [[lists:join(" ", R), "\n"] || R <- Rows]].

script(Driver, Chart = #{file := FileBase, labels := Labels, variants := Variants,
                         bars := Bars, base := Base}) ->
    #{name := Name, fig := FigLabel, better := Better} = Chart,
    Width = max(900, ?FRAME_PX + ?PX_PER_BAR * length(Bars)),
    {Lo, Hi} = range([R || {_, _, _, _, R} <- Bars]),
    ["set terminal ", Driver, io_lib:format(" size ~b,~b noenhanced~n", [Width, ?HEIGHT]),
     "set output ", str([FileBase, ".png"]), "\n",
     "set title ", str(io_lib:format("~s: ~s, x ~s (median of per-repeat ratios)",
                                     [Name, FigLabel, Base])), "\n",
     "set ylabel ", str(io_lib:format("x ~s (~s; ~s is better)", [Base, FigLabel, Better])),
     "\n",
     io_lib:format("set logscale y\nset yrange [~s:~s]\n", [num(Lo), num(Hi)]),
     "set ytics (", lists:join(", ", [[str(tic(T)), " ", num(T)] || T <- ytics(Lo, Hi)]), ")\n",
     io_lib:format("set xrange [-0.6:~s]\n", [num(length(Labels) - 0.4)]),
     xtics(Labels, chars(Width, length(Labels))),
     "set grid ytics\nset key outside right\nset datafile missing '?'\n",
     [value(B, length(Variants), length(Bars) > ?FLAT_VALUES) || B <- Bars],
     "plot ", lists:join(", \\\n     ", boxes(FileBase, Variants)
                        ++ [io_lib:format("1 with lines lc rgb 'black' lw 2 title ~s",
                                          [str([Base, " = 1"])])]), "\n"].

%% One box per variant and point, from 1 to the ratio; the variants of a point
%% side by side within 0.8 of the x axis.
boxes(FileBase, Variants) ->
    [io_lib:format("~s using ($1+~s):~b:($1+~s):($1+~s):(~s<1?~s:1):(~s<1?1:~s) "
                   "with boxxyerror ~s title ~s",
                   [str([FileBase, ".dat"]), num(Mid), C, num(Left), num(Right),
                    Col, Col, Col, Col, Style, str(Title)])
     || {I, {Title, Style}} <- enumerate(styles(Variants)),
        {Left, Mid, Right} <- [slot(I, length(Variants))],
        C <- [I + 1], Col <- [[$$, integer_to_list(C)]]].

%% A ratio written at the end of its bar: above a bar that goes up, below one
%% that goes down; upright when the bars are too narrow for it. Labels, not a
%% `with labels' plot: gnuplot 5.4 crashes on one whose every point is undefined.
value({P, I, _V, _L, R}, N, Upright) ->
    {_, Mid, _} = slot(I, N),
    Place = case {R >= 1, Upright} of
                {true, false} -> "center offset 0,0.7";
                {false, false} -> "center offset 0,-0.7";
                {true, true} -> "left rotate by 90 offset 0,0.5";
                {false, true} -> "right rotate by 90 offset 0,-0.5"
            end,
    io_lib:format("set label ~s at ~s,~s ~s font ',8'~n",
                  [str(io_lib:format("~.2f", [R])), num(P + Mid), num(R), Place]).

slot(I, N) ->
    W = 0.8 / N,
    Left = -0.4 + W * (I - 1),
    {Left, Left + W / 2, Left + W}.

%% Title and gnuplot style per variant: the limits hatched in their own colours,
%% convoy's variants (and `send_many', `batch') solid in blues and greens, the
%% others (distribution flags, `plain_again', `local', `local_call') solid greys.
styles(Variants) ->
    {Styles, _} =
        lists:mapfoldl(
          fun(V, {Cs, Os}) ->
                  case lists:keyfind(V, 1, ?LIMITS) of
                      {_, Colour, Pattern} ->
                          {{[V, " (limit)"],
                            io_lib:format("lc rgb '~s' fs pattern ~b border lc rgb '~s'",
                                          [Colour, Pattern, Colour])}, {Cs, Os}};
                      false when V =:= <<"convoy">> ->
                          {{V, solid(0, [?CONVOY_COLOUR])}, {Cs, Os}};
                      false ->
                          case is_convoy(V) of
                              true -> {{V, solid(Cs, ?CONVOY_COLOURS)}, {Cs + 1, Os}};
                              false -> {{V, solid(Os, ?OTHER_COLOURS)}, {Cs, Os + 1}}
                          end
                  end
          end, {0, 0}, Variants),
    Styles.

is_convoy(<<"convoy", _/binary>>) -> true;
is_convoy(<<"send_many">>) -> true;
is_convoy(<<"batch">>) -> true;
is_convoy(_) -> false.

solid(I, Colours) ->
    io_lib:format("lc rgb '~s' fs solid 0.85 border -1",
                  [lists:nth(I rem length(Colours) + 1, Colours)]).

%% The y range: 1 and every ratio, with room beyond them for the values written
%% at the bars' ends (a share of the axis, whatever its span).
range(Values) ->
    Lo = min(1.0, lists:min(Values)),
    Hi = max(1.0, lists:max(Values)),
    Pad = max(1.6, math:pow(Hi / Lo, 0.15)),
    {Lo / Pad, Hi * Pad}.

%% Tics at 1, 2, 5 times powers of ten, finer when that leaves fewer than four.
ytics(Lo, Hi) ->
    Within = fun(Ms) -> [T || E <- lists:seq(-4, 4), M <- Ms, T <- [times_ten(M, E)],
                              T >= Lo, T =< Hi] end,
    case Within([1, 2, 5]) of
        Ts when length(Ts) >= 4 -> Ts;
        _ -> Within([1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8])
    end.

%% Divided for negative powers: 3 * 0.1 is not 0.3 in floats, 3 / 10 is.
times_ten(M, E) when E >= 0 -> M * math:pow(10, E);
times_ten(M, E) -> M / math:pow(10, -E).

tic(T) when T == round(T) -> integer_to_list(round(T));
tic(T) -> float_to_list(float(T), [short]).

%% The points' labels under their groups, in as many lines as they need, with
%% room for them below the plot.
xtics(Labels, Max) ->
    Wrapped = [wrap(L, Max) || L <- Labels],
    ["set xtics scale 0 (",
     lists:join(", ", [[dq(lists:join("\n", Lines)), " ", integer_to_list(P - 1)]
                       || {P, Lines} <- enumerate(Wrapped)]), ")\n",
     io_lib:format("set bmargin ~b~n", [lists:max([length(Ls) || Ls <- Wrapped]) + 2])].

%% How many characters of a point's label fit under its group of bars (about 9
%% pixels a character, and a space between groups).
chars(Width, Points) ->
    max(10, (Width - ?FRAME_PX) div Points div 9 - 2).

%% A label as lines of at most `Max' characters, broken at spaces (a longer
%% word keeps its line).
wrap(Label, Max) ->
    [First | Words] = case string:lexemes(unicode:characters_to_list(Label), " ") of
                          [] -> [""];
                          Ws -> Ws
                      end,
    Lines = lists:foldl(fun(W, [Line | Done]) ->
                                case string:length(Line) + 1 + string:length(W) =< Max of
                                    true -> [Line ++ " " ++ W | Done];
                                    false -> [W, Line | Done]
                                end
                        end, [First], Words),
    lists:reverse(Lines).

variants(Summary) ->
    lists:foldl(fun(#{variant := V}, Acc) ->
                        Acc ++ [V || not lists:member(V, Acc)]
                end, [], Summary).

%% A ratio of 0 (the variant measured nothing) has no place on a log scale: no
%% bar, '?' in the `.dat'.
ratio(Summary, V, Label, Fig) ->
    case [R || #{variant := V2, point := L, status := ok, ratios := #{Fig := #{median := R}}}
                   <- Summary, V2 =:= V, L =:= Label] of
        [R | _] when R > 0 -> float(R);
        _ -> none
    end.

num(X) when is_integer(X) -> integer_to_list(X);
num(X) -> float_to_list(X, [short]).

%% A gnuplot string in single quotes, which take nothing but '' as an escape.
str(S) -> ["'", string:replace(unicode:characters_to_list(S), "'", "''", all), "'"].

%% A gnuplot string in double quotes, where "\n" breaks the line.
dq(Lines) ->
    Escaped = lists:flatmap(fun($\\) -> "\\\\";
                               ($") -> "\\\"";
                               ($\n) -> "\\n";
                               (C) -> [C]
                            end, unicode:characters_to_list(Lines)),
    [$", Escaped, $"].

header(Cols) -> ["# ", lists:join(" ", [quote(C) || C <- Cols]), "\n"].

quote(C) -> ["\"", C, "\""].

enumerate(L) -> lists:zip(lists:seq(1, length(L)), L).
